"""Seeded sampling reproduces: the same seed gives the same tokens whatever k (fixed, "auto" with any cost
table, changing every step), the batch size, the method, the draft and the replica, and they are the
target-only AR sample of that seed (coupled sampler, randomness keyed by (seed, position): specdec/sampling.py).

Bitwise in float64; in float32 and bfloat16 with batch_invariant=True."""
import json
import random

import pytest

from checkpoints import make_pair
from specdec import LLM, SamplingParams
from specdec.autok import KChooser
from specdec.request import Request
from specdec.sampling import request_seed
from choosers import ScriptedChooser, linear_costs

N = 6
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair("llama", tmp_path_factory.mktemp("seeded"))


def workload(temperature=0.8, top_k=20, top_p=0.9):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 131) for _ in range(rng.randint(1, 24))] for _ in range(N)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p, seed=100 + i,
                             ignore_eos=i % 2 == 0) for i in range(N)]
    return prompts, params


def tokens(outs):
    return [o.token_ids for o in outs]


def generate(pair, method, k, batch_size, dtype="float64", chooser=None, **kwargs):
    prompts, params = workload(**kwargs.pop("sampling", {}))
    target, draft = pair
    llm = LLM(target, None if method == "ar" else draft, method=method,
              num_speculative_tokens=None if method == "ar" else k, max_speculative_tokens=5,
              batch_size=batch_size, window_size=8, dtype=dtype, cost_cache="", **kwargs)
    if chooser is not None:
        llm.chooser = chooser
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def test_a_request_gets_its_key_when_created():
    """The key is the seed modulo 2**64 (as int64); without a seed a random one, fixed for the request."""
    assert request_seed(5) == 5 and request_seed(-1) == request_seed(2**64 - 1) == -1
    assert request_seed(2**63) == -(2**63)
    unseeded = SamplingParams(temperature=1.0)
    a, b = (Request(i, [3], unseeded, frozenset()) for i in range(2))
    assert a.seed is not None and a.seed != b.seed and -(2**63) <= a.seed < 2**63
    assert Request(0, [3], SamplingParams(temperature=1.0, seed=7), frozenset()).seed == 7
    assert Request(0, [3], SamplingParams(seed=7), frozenset()).seed is None  # greedy: no randomness


@pytest.fixture(scope="module")
def ar_sample(pair):
    """Target-only AR sampling, one request at a time: the tokens every configuration must give."""
    outs = tokens(generate(pair, "ar", None, 1))
    assert len({tuple(t) for t in outs}) == N and all(len(t) > 1 for t in outs)
    return outs


# every method, batch size and k appears; each run is compared with AR at batch 1. "auto" decides from a
# cost table where drafting pays (the tiny pair's measured costs would keep it at k = 0, i.e. AR)
PAYING = linear_costs(10e-3, 0.05e-3, 1e-3, 0.01e-3)
CONFIGS = [("ar", None, 3), ("ar", None, 8), ("eqspec", 1, 8), ("eqspec", 5, 3), ("eqspec", "auto", 1),
           ("ragged", 1, 3), ("ragged", 5, 1), ("ragged", "auto", 8), ("exspec", 5, 8), ("exspec", "auto", 3),
           ("exspec", 1, 1)]


@pytest.mark.parametrize("method,k,batch_size", CONFIGS)
def test_same_seed_same_tokens_as_target_only_ar(pair, ar_sample, method, k, batch_size):
    # draft_confidence=0: every row drafts its k (rows that stop when unsure are tests/test_stop_when_unsure.py's)
    outs = generate(pair, method, k, batch_size, check_invariants=True, draft_confidence=0,
                    chooser=KChooser(5, PAYING) if k == "auto" else None)
    assert tokens(outs) == ar_sample
    if method != "ar":
        assert 0 < outs.metrics.accepted_drafts < outs.metrics.proposed_drafts  # drafts really took part


def test_auto_k_with_different_cost_tables_and_k_changing_every_step(pair, ar_sample):
    """Two `-k auto` runs whose chooser works from different cost tables (so their k schedules differ), and
    a schedule changing k every step with k = 0 steps: the same tokens."""
    runs = []  # the model's drafts alone, every row its k (no lookup, no early stop): the tables decide the k
    for costs in (PAYING, linear_costs(10e-3, 2e-3, 1e-3, 0.2e-3)):
        runs.append(generate(pair, "ragged", "auto", 3, chooser=KChooser(5, costs), lookup=None, draft_confidence=0))
    runs.append(generate(pair, "eqspec", "auto", 3, chooser=ScriptedChooser((2, 0, 5, 1, 3, 0, 4), 5)))
    schedules = [[o.speculative_tokens for o in outs] for outs in runs]
    assert schedules[0] != schedules[1] != schedules[2]  # the steps really fell differently
    assert 0 in runs[2].metrics.k_histogram
    for outs in runs:
        assert tokens(outs) == ar_sample


def test_a_bad_draft_cannot_change_the_tokens(pair, ar_sample, tmp_path):
    """A draft from other weights (it mostly proposes wrong tokens) changes acceptance, never the output."""
    bad_target, _ = make_pair("llama", tmp_path, seed=5)
    good = generate(pair, "ragged", 3, 3)
    bad = generate((pair[0], bad_target), "ragged", 3, 3)
    assert tokens(good) == tokens(bad) == ar_sample
    assert bad.metrics.acceptance_rate < good.metrics.acceptance_rate / 2


def test_other_requests_and_their_order_change_nothing(pair, ar_sample):
    """Seeded requests among greedy, unseeded (rejection-sampled) and other seeded ones, reversed."""
    prompts, params = workload()
    extra_prompts = [[9, 9, 4], [4], [17, 3]]
    extra = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0), SamplingParams(max_tokens=MAX_TOKENS),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.5, seed=3)]
    llm = LLM(*pair, method="ragged", num_speculative_tokens=4, batch_size=4, dtype="float64")
    outs = llm.generate(prompt_token_ids=extra_prompts[:2] + prompts[::-1] + extra_prompts[2:],
                        sampling_params=extra[:2] + params[::-1] + extra[2:])
    assert tokens(outs)[2:-1] == ar_sample[::-1]


@pytest.mark.parametrize("method,k", [("eqspec", 3), ("exspec", "auto")])
def test_one_device_read_per_step_with_both_samplers(pair, method, k, monkeypatch):
    """Greedy, coupled (seeded) and rejection (unseeded) rows in one batch: drawing keyed noise, the race
    samples and the rejection rows' emitted slot read nothing from the device (tests/test_host_sync.py)."""
    from test_host_sync import reads_per_step

    prompts, params = workload()
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.9,
                             seed=i if i % 3 == 1 else None, ignore_eos=True) for i in range(N)]
    # draft_confidence=0: no row stops drafting early (where it does, on the CPU, the host reads each draft's chance)
    llm = LLM(*pair, method=method, num_speculative_tokens=k, batch_size=4, dtype="float64", check_invariants=False,
              cost_cache="", draft_confidence=0)
    if k == "auto":
        llm.chooser = KChooser(5, PAYING)
    steps = reads_per_step(llm, prompts, params, monkeypatch)
    assert all(reads == decoded + prefills for reads, prefills, decoded in steps), steps
    assert sum(d for _, _, d in steps) > 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_reproduces_in_float32_and_bfloat16(pair, dtype):
    ar = tokens(generate(pair, "ar", None, 1, dtype=dtype, batch_invariant=True))
    assert len({tuple(t) for t in ar}) == N
    for method, k, batch_size in (("eqspec", 5, 3), ("ragged", "auto", 8), ("exspec", 1, 8)):
        outs = generate(pair, method, k, batch_size, dtype=dtype, batch_invariant=True,
                        chooser=KChooser(5, PAYING) if k == "auto" else None)
        assert tokens(outs) == ar and outs.metrics.proposed_drafts > 0, method


@pytest.mark.ray
@pytest.mark.slow
def test_ray_replicas_reproduce_the_single_process_sample(tmp_path, capsys):
    """`--ray --replicas 2 -k auto` gives the single-process `-k 3` run's seeded samples, and both are the
    target-only AR run's (`--method ar`). A float64 pair with a word-level tokenizer, as tests/test_distributed.py."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    import logging

    from checkpoints import write_wordlevel_tokenizer
    from specdec.run import main

    pair = make_pair("llama", tmp_path)
    for d in pair:
        write_wordlevel_tokenizer(d, ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(128)])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 128}" for j in range(i % 9 + 1))})
                               + "\n" for i in range(3 * N)))
    base = ["--target", pair[0], "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--dtype", "float64",
            "--no-progress", "--samples", "0", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
            "--seed", "3"]
    runs = {}
    for name, extra in (("ar", ["--method", "ar", "--batch-size", "1"]),
                        ("single", ["--draft", pair[1], "--method", "ragged", "-k", "3", "--batch-size", "4"]),
                        ("ray", ["--draft", pair[1], "--method", "ragged", "-k", "auto", "--batch-size", "4",
                                 "--ray", "--replicas", "2"])):
        path = tmp_path / f"{name}.jsonl"
        if name == "ray":
            ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20,
                     logging_level=logging.ERROR)
        try:
            code = main([*base, *extra, "--output", str(path)])
        finally:
            if name == "ray":
                ray.shutdown()
        assert code == 0, capsys.readouterr().err
        runs[name] = [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]
    assert len(runs["ar"]) == 3 * N and len({tuple(t) for t in runs["ar"]}) == 3 * N  # seed + i per request
    assert runs["single"] == runs["ar"] and runs["ray"] == runs["ar"]
