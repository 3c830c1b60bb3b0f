"""specdec: batch speculative decoding that is exactly right, and fast.

`kernels/` installs as `specdec.kernels` and `models/` as `specdec.models`.
"""
import platform

from setuptools import Extension, setup

# The CPU matmul for quantized weights (kernels/cpu/, docs/kernels.md): plain C++ with OpenMP, loaded with ctypes by
# kernels/qmm_cpu.py, so it needs no torch at build time. Each instruction-set variant (AVX2, AVX-512 VNNI) is
# compiled for its own target and chosen at run time by the CPU's features. `optional`: where it cannot build, pip
# says so in a line and installs the rest; the kernel's loader then says in one line that torch multiplies float
# copies instead.
QMM = Extension(
    "specdec.kernels._qmm",
    sources=["kernels/cpu/qmm.cpp", "kernels/cpu/qmm_avx2.cpp", "kernels/cpu/qmm_avx512.cpp", "kernels/cpu/forward.cpp"],
    depends=["kernels/cpu/qmm_common.h", "kernels/cpu/forward.h", "kernels/cpu/forward_ops.h", "kernels/cpu/simd16.h"],
    # -ffp-contract=off: no product is fused into a sum unless the code says so (an explicit fmaf), so that every
    # instruction-set variant performs the same float operations (kernels/cpu/forward_ops.h)
    extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
    language="c++",
    optional=True,
)

SERVE = ["fastapi>=0.100", "uvicorn>=0.23", "prometheus-client>=0.17", "pydantic>=2"]

setup(
    name="specdec",
    version="0.1.0",
    description="Batch speculative decoding runtime: exact EQSPEC/EXSPEC/ragged strategies with Triton kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["specdec", "specdec.schedulers", "specdec.serve", "specdec.proposers", "specdec.kernels", "specdec.models",
              "specdec.train", "specdec.draft_vocab"],
    package_dir={
        "specdec": "specdec",
        "specdec.schedulers": "specdec/schedulers",
        "specdec.kernels": "kernels",
        "specdec.models": "models",
    },
    package_data={"specdec": ["assets/prompts.txt", "assets/default_pair/*/*", "assets/drafts/*/*",
                              "assets/draft_vocab/*.npz"],
                  "specdec.train": ["default_pair_template.md"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "tqdm",
        "numpy",
    ],
    extras_require={
        # `python -m specdec.serve` (docs/serve.md); tests/test_serve.py drives it with the openai client
        "serve": SERVE,
        "test": ["pytest", "pytest-benchmark", "hypothesis", "transformers>=4.51", "protobuf", "jinja2", "matplotlib",
                 "gguf>=0.10", "accelerate",
                 "ray[data]==2.60.0", *SERVE, "openai>=1.0", "httpx>=0.24"],
        "bench": ["matplotlib", "pytest-benchmark"],
        # `python -m specdec.train` (docs/train.md): `small` builds and saves its Llama models with transformers,
        # which reads the SentencePiece model it trains through protobuf; matplotlib draws the acceptance plot
        # (skipped, with a line, without it)
        "train": ["transformers>=4.51", "protobuf", "matplotlib"],
        # the CPU peer of bench/quantized.py (llama.cpp): a ~12-minute source build; build the wheel once with the
        # flags docs/benchmarks/quantized.md gives (native flags and OpenMP crash here) and install it from the cache
        "llamacpp": ["llama-cpp-python[server]==0.3.36", "diskcache"],  # [server]: bench/serve.py chat and mixed
        # GGUF files (load_model / load_tokenizer on a .gguf, python -m specdec.convert): the gguf reader's
        # dequantizers; jinja2 renders the chat template the file carries
        "gguf": ["gguf>=0.10", "jinja2"],
        # --ray (docs/distributed.md): Ray Data brings pandas and pyarrow; tested with 2.60.0, and 2.64
        # removes the `ray_remote_args` that sets a block's retry budget
        "ray": ["ray[data]>=2.60,<2.64"],
    },
    ext_modules=[QMM] if platform.system() == "Linux" else [],
    entry_points={"console_scripts": ["specdec=specdec.run:main"]},
)
