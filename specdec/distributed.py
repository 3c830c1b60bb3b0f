"""Scale-out on Ray: one prompt set decoded by N replicas, each a Ray actor holding one `LLM`.

    python -m specdec.run --ray --replicas 2 --prompts big.jsonl --output out.jsonl

How a job flows (docs/distributed.md says why):

1. The driver makes one streaming pass over the prompt file and keeps only where every `block_size`-th
   prompt starts (byte offset, line): O(prompts / block_size) small chunk descriptors, plus the total.
2. Ray Data reads each chunk into a block of rows {index, prompt}, on the driver's node (so the file need
   not exist on the other nodes), one read task at a time.
3. `map_batches` hands each block to a replica of an actor pool (`ActorPoolStrategy(size=N)`; one GPU per
   replica on a GPU cluster, one CPU otherwise). A replica loads the models once and decodes one block per
   call. Request i samples with seed + i; its random numbers depend only on (seed, position) and it is
   coupled-sampled (docs/design.md, "Randomness"), so its output does not depend on which replica decodes
   it, how many replicas there are, or the k each replica's auto-k chooses.
4. The driver receives the blocks in prompt order (Ray Data's `preserve_order`: a block that finishes
   early waits in Ray's object store, bounded by Ray's backpressure and spilled to disk if need be, never
   in the driver), streams their lines to --output, drives one progress bar and sums the blocks' metrics.

Failures: a replica process that dies is restarted by Ray and its blocks are resubmitted; an exception
while decoding a block retries that block; both through Ray's actor-task retries (`max_task_retries`).
The driver checks that every index arrives exactly once, in order. A bad request (say, a prompt longer
than the context) becomes an `error` on its own output line and does not fail its block.

This module is the driver; what runs inside Ray's workers (the read task and the `Replica` actor) is
specdec/ray_replica.py. Ray is imported only when a job runs: `add_arguments` and the checks are free without it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

from .flags import engine_kwargs, positive_int
from .prompts import iter_prompt_file
from .ray_replica import Replica, read_chunk

RAY_EXTRA = 'pip install -e ".[ray]"'
NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in label naming each node
LOCAL_OBJECT_STORE_BYTES = 512 << 20  # a local instance's object store: blocks are text and token ids
BATCHES_PER_BLOCK = 4  # a block holds this many batches of prompts (at least an EXSPEC window)
MAX_BLOCK_RETRIES = 3  # attempts after the first, per block, whether its replica died or raised
TASKS_IN_FLIGHT_PER_REPLICA = 1  # a block goes to a replica when it is free: none waits queued behind a slow
# one (or behind the first replica to start) while another idles; the hand-over costs milliseconds
RAY_RETRY_NOTE = "\nFailed to apply UDF transform"  # what Ray Data appends to a failed block's exception


# ----------------------------------------------------------------------------------------------- CLI flags
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--ray`, `--ray-address` and `--replicas` flags of `python -m specdec.run`."""
    group = parser.add_argument_group("scale-out on Ray (docs/distributed.md)")
    group.add_argument("--ray", action="store_true", help="decode on replicas (Ray actors, one LLM each) fed "
                       f"by Ray Data; output in prompt order; needs the ray extra ({RAY_EXTRA})")
    group.add_argument("--ray-address", metavar="ADDR", help="with --ray: join this running cluster (the "
                       "address `ray start --head` prints, e.g. 10.0.0.1:6379); default: start a local Ray instance")
    group.add_argument("--replicas", type=positive_int, help="with --ray: number of replicas, each on one GPU "
                       "(or one CPU with --device cpu or on a cluster without GPUs); default: one per GPU (CPU)")


def wants_ray(args) -> bool:
    """True when the run goes to Ray; the Ray-only flags without --ray are an error."""
    if getattr(args, "ray", False):
        return True
    for flag, value in (("--ray-address", getattr(args, "ray_address", None)),
                        ("--replicas", getattr(args, "replicas", None))):
        if value is not None:
            raise ValueError(f"{flag} needs --ray")
    return False


def import_ray():
    """`ray` with Ray Data, or the one-line error naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401  (pulls pandas and pyarrow: the "data" extra of ray)
    except ImportError as err:
        raise ValueError(f"--ray needs Ray, which is not installed ({err}); install the extra: {RAY_EXTRA}") from None
    return ray


# ----------------------------------------------------------------------------------------- prompt streaming
def plan_chunks(inline: list[str], path: str | None, limit: int | None, block_size: int) -> tuple[list[dict], int]:
    """Chunk descriptors covering the inline prompts (carried as text) then the file's (located by byte
    offset), `block_size` prompts each, at most `limit` in all; and the number of prompts. Reads the file
    once, line by line, so that its errors surface before any replica starts."""
    chunks, total = [], 0
    for start in range(0, len(inline), block_size):
        part = inline[start: start + block_size][: None if limit is None else max(limit - total, 0)]
        if part:
            chunks.append({"first": total, "count": len(part), "prompts": part})
            total += len(part)
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: prompt file not found")
        before, found = total, False
        for offset, number, _ in iter_prompt_file(path):
            found = True
            if limit is not None and total >= limit:
                break
            if (total - before) % block_size == 0:
                chunks.append({"first": total, "count": 0, "path": path, "offset": offset, "line": number})
            chunks[-1]["count"] += 1
            total += 1
        if not found:
            raise ValueError(f"{path}: no prompts in file")
    return chunks, total


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class Placement:
    """Where replicas run: Ray resources per replica, the torch device inside it, torch threads."""

    replicas: int
    resources: dict
    device: str
    threads: int | None


def place_replicas(device_spec: str, replicas: int | None, cluster: dict, strict: bool,
                   blocks: int | None = None) -> Placement:
    """One GPU per replica when the device asks for CUDA (or "auto" and the cluster has GPUs), else one CPU
    (and one torch thread); no more replicas than `blocks` (a replica without a block would only load the
    models). Fewer resources than replicas: an error when `strict` (a local instance cannot grow), else a
    warning (an autoscaling cluster may add nodes)."""
    spec = str(device_spec).strip().lower()
    gpus, cpus = int(cluster.get("GPU", 0)), int(cluster.get("CPU", 0))
    if spec == "auto":
        use_gpu = gpus > 0
    elif spec == "cpu":
        use_gpu = False
    elif spec.startswith("cuda"):
        use_gpu = True
    else:
        raise ValueError(f"--device {device_spec} is not supported with --ray (use auto, cpu or cuda: each "
                         "replica gets its own GPU)")
    kind, have = ("GPU", gpus) if use_gpu else ("CPU", cpus)
    if replicas is None:
        replicas = have
        if replicas < 1:
            raise ValueError(f"--device {device_spec}: the Ray cluster has no {kind}s")
    if blocks is not None:
        replicas = max(min(replicas, blocks), 1)
    if replicas > have:
        message = (f"--replicas {replicas} needs {replicas} {kind}s (one per replica) but the Ray cluster has "
                   f"{have}")
        if strict:
            raise ValueError(message)
        print(f"specdec: warning: {message}; waiting for the cluster to add them", file=sys.stderr)
    resources = {"num_gpus": 1, "num_cpus": 1} if use_gpu else {"num_cpus": 1}
    return Placement(replicas, resources, "cuda" if use_gpu else "cpu", None if use_gpu else 1)


def default_block_size(method: str, batch_size: int, window_size: int) -> int:
    """Prompts per block: a few batches (an EXSPEC window at least), so a replica's scheduler has a queue
    to refill from, while a lost block costs little to redo."""
    size = BATCHES_PER_BLOCK * batch_size
    return max(size, window_size) if method == "exspec" else size


def connect(ray, address: str | None) -> bool:
    """Join `address`, or start a local instance (no dashboard, a modest object store). Reuses an instance
    this process already joined. Returns whether we started the connection (and so should end it)."""
    if ray.is_initialized():
        return False
    quiet = dict(logging_level=logging.ERROR, log_to_driver=True)  # Ray's chatter off; replicas' stderr shown
    if address:
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError) as err:
            raise ValueError(f"--ray-address {address}: cannot join the Ray cluster ({err})") from None
    else:
        ray.init(address="local", include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    return True


SETTINGS = {  # Ray Data settings for our jobs (DataContext attributes)
    "enable_progress_bars": False,  # we draw one bar for the whole job
    "print_on_execution_start": False,
    "actor_task_retry_on_errors": True,  # retry a block that raised, up to max_task_retries times
    "raise_original_map_exception": True,  # a replica's CheckpointError arrives as itself, not as text
}


@contextmanager
def data_context(ray):
    """Ray Data settings for one job, restored afterwards; blocks are delivered in order."""
    ctx = ray.data.DataContext.get_current()
    saved = {name: getattr(ctx, name) for name in SETTINGS}
    saved_order = ctx.execution_options.preserve_order
    for name, value in SETTINGS.items():
        setattr(ctx, name, value)
    ctx.execution_options.preserve_order = True
    logger = logging.getLogger("ray.data")
    saved_level = logger.level
    logger.setLevel(logging.CRITICAL)  # failures reach the user as our exception, not as Ray Data's log lines
    try:
        yield ctx
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.execution_options.preserve_order = saved_order
        logger.setLevel(saved_level)


def generate_blocks(ray, chunks: list[dict], replica_kwargs: dict, placement: Placement):
    """Run the job; yield each block's rows (dicts), blocks in prompt order, as they are delivered."""
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    driver_node = ray.get_runtime_context().get_node_id()
    with data_context(ray):
        ds = ray.data.from_items([{"chunk": json.dumps(c)} for c in chunks], override_num_blocks=len(chunks))
        # reads run on this node (the prompt file is here), one at a time: reading is cheap, and each
        # concurrent zero-CPU task would start a worker process of its own
        ds = ds.flat_map(read_chunk, compute=TaskPoolStrategy(size=1), num_cpus=0,
                         label_selector={NODE_ID_LABEL: driver_node})
        with warnings.catch_warnings():  # max_task_retries has no named parameter yet in Ray 2.60-2.63
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map_batches(Replica, batch_size=None, batch_format="numpy", fn_constructor_kwargs=replica_kwargs,
                                compute=ActorPoolStrategy(size=placement.replicas,
                                                          max_tasks_in_flight_per_actor=TASKS_IN_FLIGHT_PER_REPLICA),
                                max_task_retries=MAX_BLOCK_RETRIES, **placement.resources)
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            yield table.to_pylist()


def unwrap_error(err: BaseException) -> BaseException:
    """The user-facing error inside a Ray exception (a CheckpointError, ValueError, TypeError or OSError
    raised in a replica: run.py prints it as one line), without the retry note Ray Data appends to its
    message; else `err` itself (a bug: its traceback, with the replica's, is what helps)."""
    from specdec.models import CheckpointError

    seen = set()
    current = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        ray_wrapper = type(current).__module__.startswith("ray.")  # e.g. RayTaskError(CheckpointError)
        if isinstance(current, (CheckpointError, ValueError, TypeError, OSError)) and not ray_wrapper:
            if current.args and isinstance(current.args[0], str):
                current.args = (current.args[0].split(RAY_RETRY_NOTE)[0],) + current.args[1:]
            return current
        current = getattr(current, "cause", None) or current.__cause__
    return err


def output_record(row: dict) -> dict:
    """The JSONL line of one request: the single-process CLI's record, or {index, prompt, error}."""
    if row["error"] is not None:
        return {"index": row["index"], "prompt": row["prompt"], "error": row["error"]}
    from .output import record

    return record(SimpleNamespace(**row), row["prompt"])


def add_counters(metrics, counters: dict) -> None:
    for name, value in counters.items():
        if isinstance(value, dict):
            bucket = getattr(metrics, name)
            for key, v in value.items():
                key = int(key) if name == "k_histogram" else key  # JSON made the k keys strings
                if isinstance(v, list):  # drafts_by_drafter: [proposed, accepted] per drafter, summed apart
                    bucket[key] = [a + b for a, b in zip(bucket.get(key, [0] * len(v)), v)]
                else:
                    bucket[key] = bucket.get(key, 0.0) + v
        else:
            setattr(metrics, name, getattr(metrics, name) + value)


def run_distributed(args, sink=None) -> int:
    """`python -m specdec.run --ray ...`: the whole job, from flags that run.py has validated up to here."""
    from .prompts import DEFAULT_PROMPTS

    if args.compare_ar:
        raise ValueError("--compare-ar is not available with --ray (decode with --method ar --ray and compare "
                         "the two --output files)")
    ray = import_ray()
    block_size = default_block_size(args.method, args.batch_size, args.window_size)
    path = args.prompts or (None if args.prompt else DEFAULT_PROMPTS)
    chunks, total = plan_chunks(list(args.prompt or []), path, args.num_prompts, block_size)

    t0 = time.perf_counter()
    owned = connect(ray, args.ray_address)
    join_s = time.perf_counter() - t0
    try:
        placement = place_replicas(args.device, args.replicas, ray.cluster_resources(), strict=not args.ray_address,
                                   blocks=len(chunks))
        llm_kwargs = engine_kwargs(args, device=placement.device)  # every engine flag, as in one process
        sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed)
        replica_kwargs = dict(llm_kwargs=llm_kwargs, sampling=sampling, chat=args.chat, threads=placement.threads)
        job = stream_job(ray, chunks, total, replica_kwargs, placement, sink, progress=not args.no_progress,
                         samples=max(args.samples, 0))
    finally:
        if owned:
            ray.shutdown()
    print_summary(job, args, placement, join_s, block_size)
    if sink is not None:
        print(f"{'streamed' if sink.stream else 'wrote'} {total} requests to {args.output}")
    return 0


@dataclass
class JobResult:
    metrics: object  # RunMetrics summed over the blocks; wall time and tokens/s of the whole job
    errors: int  # requests answered with an `error`
    samples: list  # the first rows, for the CLI to print
    first_block_s: float  # from the job's start to the first block delivered (start-up + one block)
    busy_s: float  # replicas' time inside `generate`, summed over the blocks delivered
    replicas: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the replicas together while decoding: start-up and hand-overs left out."""
        per_replica_s = self.busy_s / max(self.replicas, 1)
        return self.metrics.generated_tokens / per_replica_s if per_replica_s else 0.0

    @property
    def utilisation(self) -> float:
        """The share of the replicas' job time spent decoding (the rest: start-up, hand-overs, the tail)."""
        total_s = self.metrics.wall_time_s * self.replicas
        return self.busy_s / total_s if total_s else 0.0


def stream_job(ray, chunks: list[dict], total: int, replica_kwargs: dict, placement: Placement, sink=None,
               progress: bool = True, samples: int = 0) -> JobResult:
    """Run the job: stream the rows, in prompt order, to `sink` (run.py's JsonlOutput, or None), one progress
    bar and the merged metrics; check that each of the `total` indices arrives exactly once."""
    from tqdm import tqdm

    from specdec.metrics import RunMetrics

    llm_kwargs = replica_kwargs["llm_kwargs"]
    metrics = RunMetrics(llm_kwargs["method"], llm_kwargs["batch_size"], num_requests=total)
    out = sink  # lines arrive in prompt order: streamed as they are, the partial file renamed at the end
    bar = tqdm(total=total, desc=f"ray x{placement.replicas} {metrics.method}", unit="req", dynamic_ncols=True,
               disable=not progress)
    kept, errors, expected, first_block_s, busy_s = [], 0, 0, 0.0, 0.0
    t0 = time.perf_counter()
    try:
        for rows in generate_blocks(ray, chunks, replica_kwargs, placement):
            first_block_s = first_block_s or time.perf_counter() - t0
            for row in rows:
                if row["index"] != expected:
                    raise RuntimeError(f"Ray delivered request {row['index']} where {expected} was due: a block "
                                       "was lost or duplicated")
                expected += 1
                if row["block_metrics"]:
                    block = json.loads(row["block_metrics"])
                    add_counters(metrics, block["counters"])
                    busy_s += block["wall_s"]
                if row["error"] is not None:
                    errors += 1
                else:
                    metrics.latencies_s.append(row["latency_s"])
                    metrics.ttfts_s.append(row["time_to_first_token_s"])
                if len(kept) < samples:
                    kept.append(row)
                if out is not None:
                    out.write_record(output_record(row))
            bar.update(len(rows))
            bar.set_postfix_str(f"{metrics.generated_tokens / (time.perf_counter() - t0):.1f} tok/s", refresh=False)
    except Exception as err:  # a replica's CheckpointError/ValueError surfaces as itself: one line in main
        cause = unwrap_error(err)
        if cause is not err:
            raise cause from None
        raise
    finally:
        bar.close()
    if expected != total:
        raise RuntimeError(f"Ray delivered {expected} of {total} requests")
    metrics.wall_time_s = time.perf_counter() - t0
    if out is not None:
        out.commit_streamed()
    return JobResult(metrics, errors, kept, first_block_s, busy_s, placement.replicas)


def print_summary(job: JobResult, args, placement: Placement, join_s: float, block_size: int) -> None:
    """Samples, the single-process CLI's summary table, and what the Ray job cost to start."""
    from .summary import metrics_row, summary_table

    for row in job.samples:
        if row["error"] is not None:
            print(f"--- request {row['index']} (error: {row['error']})")
            continue
        print(f"--- request {row['index']} ({len(row['token_ids'])} tokens, {row['finish_reason']})")
        text = row["text"] or ""
        print(row["prompt"] + "\033[1m" + text + "\033[0m" if sys.stdout.isatty() else row["prompt"] + text)
    m = job.metrics
    print()
    print(summary_table([metrics_row(m, args.num_speculative_tokens, None)]))
    each = "1 GPU" if "num_gpus" in placement.resources else "1 CPU, 1 torch thread"
    print(f"\n{m.num_requests} requests ({job.errors} with an error), {m.generated_tokens} tokens in "
          f"{m.wall_time_s:.2f} s on {placement.replicas} replica(s) ({each} each); target forwards "
          f"{m.target_forwards}, draft forwards {m.draft_forwards}; dtype {args.dtype}, device {placement.device}")
    print(f"Ray: joined in {join_s:.2f} s; first block after {job.first_block_s:.2f} s (replicas start, load the "
          f"models and decode it); blocks of {block_size} prompts; replicas decoding {job.utilisation:.0%} of the "
          f"job, {job.decode_tokens_per_s:.1f} tokens/s together while they do")
