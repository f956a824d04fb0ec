"""Test matrix: one virtualenv per backend (their pins cannot share one environment; see README)."""

import functools
import os
import shutil

import nox

nox.options.sessions = ["tests-numpy", "tests-torch", "tests-paddle", "tests-paddle-torch", "tests-jax", "docs"]
nox.options.error_on_missing_interpreters = True

TEST = ["pytest", "pytest-xdist", "hypothesis", "numpy"]
TORCH = [
    "torch==2.13.0",
    "diffusers==0.42.1",
    "transformers==5.23.0",
    "tomesd==0.1.3",
    "peft==0.21.2",  # LoRA-after-patch test
    "accelerate==1.15.0",  # CPU-offload test
    "scikit-image==0.26.0",  # the trained models' data and sample metrics
]
# The ldm package (A1111-style UIs, sdkit) from the stable-diffusion-sdkit wheel: its own pins (pytorch-lightning 1.4,
# transformers 4.33, ...) cannot sit beside torch 2.13, so it installs --no-deps with the modules its UNet imports.
LDM = ["einops==0.8.2", "omegaconf==2.4.0"]
LDM_NO_DEPS = ["stable-diffusion-sdkit==2.1.5"]
PADDLE = [
    "paddlepaddle==3.3.1",
    "huggingface_hub==0.25.2",
    "aistudio-sdk==0.2.6",
    "datasets",
    "colorlog",
    "jinja2",
    "jieba",
    "sentencepiece",
    "scipy",
    "regex",
    "seqeval",
    "fastapi",
    "ftfy",
]
PADDLE_NO_DEPS = ["ppdiffusers==0.29.0", "paddlenlp==2.8.1"]
JAX = ["jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8", "diffusers==0.39.0", "transformers==4.57.6", "torch==2.13.0"]


def drops_its_venv(session_function):
    """With TOME_DROP_VENVS=1 (CI), a session deletes its virtualenv when it ends, passed or failed: the
    matrix's environments hold about 1.5 GB each, more than a shared CI disk always has free at once."""

    @functools.wraps(session_function)
    def run(session):
        try:
            session_function(session)
        finally:
            if os.environ.get("TOME_DROP_VENVS") == "1":
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)

    return run


# Two workers on CI's two cores, each with one intra-op thread: the models are tiny, and a framework's thread
# pool spinning beside another process's costs more than it parallelises (the torch session: 21 minutes on one
# worker with two threads, 6 with two workers of one thread). HYPOTHESIS_PROFILE=ci: the same examples on every
# run (tests/conftest.py), so a red CI is reproducible; a run elsewhere draws new ones.
PARALLEL = ["-n", "2", "--dist", "worksteal"]
CI_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": "ci"}


def run_tests(session, backends, *folders, env=None, core=True):
    session.run(
        "pytest", *PARALLEL, *(["tests/core"] if core else []), *folders, *session.posargs,
        env={"TOME_TEST_BACKENDS": backends, **CI_ENV, **(env or {})},
    )


@nox.session(name="tests-numpy")
@drops_its_venv
def tests_numpy(session):
    session.install(*TEST)
    session.install(".")
    run_tests(session, "numpy")


@nox.session(name="tests-torch")
@drops_its_venv
def tests_torch(session):
    session.install(*TEST, *TORCH, "tqdm", "matplotlib")
    # Speed-ups that tests/torch/test_compose.py stacks with ToMe; --no-deps: tgate pins DeepCache and pulls
    # accelerate. (HiDiffusion 0.1.10 does not import with diffusers 0.42: docs/works-with.md.)
    session.install("--no-deps", "DeepCache==0.1.1", "tgate==1.0.0")
    session.install(*LDM)
    session.install("--no-deps", *LDM_NO_DEPS)  # tests/torch/test_ldm.py
    session.install(".")
    run_tests(session, "numpy,torch", "tests/torch")


@nox.session(name="tests-paddle")
@drops_its_venv
def tests_paddle(session):
    session.install(*TEST, *PADDLE, "tqdm")
    session.install("--no-deps", *PADDLE_NO_DEPS)
    session.install(".")
    # tests/paddle/test_torch_parity.py skips itself here (no torch): it runs in tests-paddle-torch.
    run_tests(session, "numpy,paddle", "tests/paddle")


@nox.session(name="tests-paddle-torch")
@drops_its_venv
def tests_paddle_torch(session):
    """Cross-framework parity: the same UNet and SD3 transformer weights patched on torch and on paddle give the
    same output.

    diffusers 0.32.2 is the newest torch diffusers that installs beside ppdiffusers' huggingface_hub pin.
    """
    session.install(*TEST, *PADDLE, "torch==2.13.0", "diffusers==0.32.2")
    session.install("--no-deps", *PADDLE_NO_DEPS)
    session.install(".")
    # tests/core ran on each backend in its own session already
    run_tests(session, "numpy,paddle,torch", "tests/paddle/test_torch_parity.py", core=False)


@nox.session(name="tests-jax")
@drops_its_venv
def tests_jax(session):
    """jax + Flax diffusers (0.39.0, the last with Flax); torch for the torch<->Flax parity test.

    XLA compilation dominates (every traced model, and eagerly every op per new shape), so the tests run on
    two workers and XLA's CPU backend skips its slow LLVM optimisations (a quarter less compile time; the
    same operations, only less optimised machine code).
    """
    # --no-compile: no .pyc for the thousands of torch/transformers files the tests never import.
    session.install("--no-compile", *TEST, *JAX, "tqdm", "matplotlib")
    session.install("--no-compile", ".")
    run_tests(
        session, "numpy,jax", "tests/jax",
        env={"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"},
    )


@nox.session
def docs(session):
    """The guides (docs/) as a site: MkDocs, warnings as errors (mkdocs.yml: strict, links checked)."""
    session.install("mkdocs==1.6.1")
    session.run("mkdocs", "build", "--strict", "--site-dir", session.create_tmp())
