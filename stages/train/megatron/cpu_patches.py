"""Patches that let megatron-core (seen with 0.16.1) train on CPU over gloo.

megatron-core assumes a CUDA device in a few places that the CPU path still reaches. Each patch
below fixes one of them, is a named function, and is applied by `apply_cpu_patches(device=...)` only when
megatron runs on the CPU (`needs_cpu_patches`: the trainer rank's device is the CPU, i.e. Ray assigned it
no GPU or CUDA is absent; with device=None, when `torch.cuda.is_available()` is False). On a GPU nothing is
touched and megatron-core runs as released. tests/stages/test_megatron_patches.py shows, for each patch,
that the unpatched call fails on CPU, and that a CUDA device gets no patch.

- patch_rng_tracker: the model-parallel RNG tracker (`model_parallel_cuda_manual_seed`,
  `get_cuda_rng_tracker().fork()`, used around attention dropout) stores CUDA generator states;
  the patched tracker stores CPU generator states instead.
- patch_current_device: `torch.cuda.current_device()` names the device of p2p receive buffers
  (pipeline schedules) and other scratch tensors; on CPU it returns "cpu".
- patch_schedule_tensors: `pipeline_parallel/schedules.py` allocates its token counter with a
  hard-coded `device="cuda"`; the module gets a torch namespace whose factories map cuda to cpu.
- patch_tensor_cuda: with tied embeddings and PP > 1, `LanguageModule.setup_embeddings_and_output_layer`
  moves the last stage's embedding copy with `weight.data.cuda()`; on CPU `.cuda()` is a no-op.
"""

from __future__ import annotations

import contextlib
import types

import torch

_APPLIED: list[str] = []


def patch_rng_tracker() -> None:
    """Make megatron's CUDA RNG states tracker keep CPU generator states."""
    from megatron.core.tensor_parallel import random as mrandom  # noqa: PLC0415 - optional extra

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Same bookkeeping as CudaRNGStatesTracker, over torch's CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


def patch_current_device() -> None:
    """`torch.cuda.current_device()` returns "cpu" (a valid `device=` argument)."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _cpu_device(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cuda":
        kwargs = {**kwargs, "device": "cpu"}
    return kwargs


class _CpuTorch(types.ModuleType):
    """torch, except that tensor factories called with a CUDA device allocate on CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return lambda *a, **k: attr(*a, **_cpu_device(k))
        return attr


def patch_schedule_tensors() -> None:
    """`pipeline_parallel/schedules.py` sees a torch whose factories map device="cuda" to cpu."""
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415 - optional extra

    schedules.torch = _CpuTorch()


def patch_tensor_cuda() -> None:
    """`Tensor.cuda()` returns the tensor itself (it is already where it lives: on CPU)."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


CPU_PATCHES = (patch_rng_tracker, patch_current_device, patch_schedule_tensors, patch_tensor_cuda)


def needs_cpu_patches(device: torch.device | str | None = None) -> bool:
    """Whether megatron on `device` needs the patches: only on the CPU. device None: this process's default
    device (cuda when torch.cuda.is_available(), else cpu)."""
    if device is None:
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def apply_cpu_patches(exclude: tuple[str, ...] = (), *, device: torch.device | str | None = None) -> list[str]:
    """Apply every patch once when megatron runs on the CPU (needs_cpu_patches(device)); returns the names
    applied so far in this process, [] on a GPU (nothing is touched).

    Args:
        exclude: patch names to leave out (the tests use it to show each patch is needed).
        device: the trainer rank's device (ActorWorker.device); None: this process's default.
    """
    if not needs_cpu_patches(device):
        return []
    unknown = set(exclude) - {p.__name__ for p in CPU_PATCHES}
    if unknown:
        raise ValueError(f"Unknown CPU patch {sorted(unknown)}. Valid: {[p.__name__ for p in CPU_PATCHES]}")
    for patch in CPU_PATCHES:
        if patch.__name__ not in _APPLIED and patch.__name__ not in exclude:
            patch()
            _APPLIED.append(patch.__name__)
    return list(_APPLIED)
