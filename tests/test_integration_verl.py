"""roundalign.integrations.verl: the seam call, Fair Cast on FSDP shards, activation, and verl's real FSDP engine.

The exporter and seam tests need only torch and transformers. The rest run verl 0.9.1's own code
(from requirements/trainer.lock) on the CPU; see tests/verl_cpu.py for what is adjusted for this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import roundalign
from roundalign.integrations.verl import (
    SETUP_HOOK,
    ShardExporter,
    flat_offset,
    patch_actor,
    ray_runtime_env,
    settings_from_env,
)
from roundalign.sync import ExportState, export_bf16, tensor_seed
from tests.verl_cpu import MODEL, require_verl


def _masters(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 0.02
    m[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.4e38, -0.0])  # non-finite, overflow, -0
    return m


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _cuts(n: int) -> list[tuple[int, int]]:
    edges = [0, 7, 8, 65_571, 200_003, n]  # uneven slabs, one of a single element, none on a 32-element group edge
    return list(zip(edges[:-1], edges[1:], strict=True))


# ---- ShardExporter: shards add up to the full-tensor export ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_stochastic_shards_equal_the_full_export(dtype):
    # docs/verl.md: the union of the shards is the full tensor's export with key tensor_seed(seed, name) at step
    # version; fp16's extra draws (values below 2^-24) are indexed by element too, so fp16 shards add up as well.
    n, name, seed = 300_077, "model.layers.0.mlp.up_proj.weight", 11
    m = _masters(n, 0)
    m[1000:1100] *= 2.0**-30  # fp16's tiny range, in the second and later shards
    m[70_000:70_100] *= 2.0**-30
    for version in (0, 1):
        want = export_bf16(m, "stochastic", ExportState(key=tensor_seed(seed, name), step=version), dtype)
        exporter = ShardExporter("stochastic", seed=seed, dtype=dtype)
        exporter.version = version
        got = torch.cat([exporter.export(name, m[a:b].clone(), a) for a, b in _cuts(n)])
        assert torch.equal(_bits(got), _bits(want))
        again = torch.cat([exporter.export(name, m[a:b].clone(), a) for a, b in _cuts(n)])
        assert torch.equal(_bits(again), _bits(want))  # idempotent within a version
    assert not torch.equal(_bits(want), _bits(export_bf16(m, "stochastic", ExportState.seeded(0), dtype)))


def test_error_feedback_shards_follow_one_full_state_across_versions():
    n, name = 3000, "w"
    cuts = [(0, 1000), (1000, 1001), (1001, 3000)]
    shard_exporters = [ShardExporter("error-feedback") for _ in cuts]  # one per rank
    full_state = ExportState()
    m = _masters(n, 1)
    for version in range(5):
        want = export_bf16(m, "error-feedback", full_state)  # the reference: one export per version, full tensor
        for _ in range(2):  # verl exports the same weights twice (seed sync + delta snapshot): same bits both times
            ranks = zip(shard_exporters, cuts, strict=True)
            got = torch.cat([ex.export(name, m[a:b].clone(), a) for ex, (a, b) in ranks])
            assert torch.equal(_bits(got), _bits(want)), version
        for ex in shard_exporters:
            ex.next_version()
        m = m + 1e-5 * torch.randn(n, generator=torch.Generator().manual_seed(version))  # an optimizer step


def test_rne_is_the_plain_cast():
    m = _masters(1000, 2)
    assert torch.equal(_bits(ShardExporter("rne").export("w", m, 0)), _bits(m.to(torch.bfloat16)))


def test_exporter_state_round_trip_continues_bitwise():
    m, ex = _masters(500, 3), ShardExporter("error-feedback")
    ex.export("w", m, 0)
    ex.next_version()
    copy = ShardExporter("error-feedback")
    copy.load_state_dict(ex.state_dict())
    assert torch.equal(_bits(copy.export("w", m, 0)), _bits(ex.export("w", m, 0)))
    with pytest.raises(ValueError, match="differently configured"):
        ShardExporter("stochastic").load_state_dict(ex.state_dict())


def test_exporter_bad_input():
    with pytest.raises(ValueError, match="unknown sync mode"):
        ShardExporter("round")
    with pytest.raises(TypeError, match="fp32 master"):
        ShardExporter("stochastic").export("w", torch.zeros(4, dtype=torch.bfloat16), 0)
    ex = ShardExporter("error-feedback")
    ex.export("w", torch.zeros(4), 0)
    with pytest.raises(ValueError, match="shard moved"):
        ex.export("w", torch.zeros(4), 4)
    assert flat_offset(torch.zeros(3, 2)) == 0


# ---- patch_actor at the seam ----------------------------------------------------------------------------------------


def _fp32_actor():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")


def _liger_like(model, restore_classes: bool):
    """Liger 0.8.5's instance patching, reproduced (Liger needs Triton, so it is not run here): its
    ``_bind_method_to_module`` puts forward/extra_repr/_get_name in the instance ``__dict__``; a model built after
    ``apply_liger_kernel_to_qwen3`` holds Liger classes instead."""
    liger = types.ModuleType("liger_kernel.transformers.rms_norm")
    exec(
        "def forward(self, x):\n    raise AssertionError('Liger kernel ran')\n"
        "def extra_repr(self):\n    return 'liger'\n"
        "class LigerRMSNorm(__import__('torch').nn.Module):\n    pass\n"
        "class LigerSwiGLUMLP(__import__('torch').nn.Module):\n    pass\n",
        liger.__dict__,
    )
    count = 0
    for name, sub in model.named_modules():
        kind = "LigerRMSNorm" if name.endswith("norm") else "LigerSwiGLUMLP" if name.endswith("mlp") else None
        if kind is None:
            continue
        sub.__dict__["forward"] = liger.forward.__get__(sub, type(sub))
        sub.__dict__["extra_repr"] = liger.extra_repr.__get__(sub, type(sub))
        if restore_classes:
            sub.__class__ = getattr(liger, kind)
        count += 1
    return count


@pytest.mark.parametrize("restore_classes", [False, True], ids=["liger-bound", "liger-classes"])
def test_patch_actor_undoes_liger_and_matches_apply(restore_classes):
    ids = torch.randint(1, 264, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = roundalign.apply(_fp32_actor(), "vllm", allow_non_bf16=True)
    actor = _fp32_actor()
    patched = _liger_like(actor, restore_classes)
    report = patch_actor(actor, "vllm")
    assert len(report.liger_bindings_removed) == 2 * patched
    assert len(report.liger_classes_restored) == (patched if restore_classes else 0)
    assert report.fsdp_wrap_classes == ["AlignedQwen3DecoderLayer"]
    assert type(actor)._no_split_modules == ["Qwen3DecoderLayer"]  # the HF class keeps its own list
    assert report.aligned_modules == 4 * (1 + 4 + 1 + 1) + 1 + 1  # layers x (layer, 4 norms, mlp, attn), norm, rotary
    with torch.no_grad():
        want = reference.to(torch.bfloat16)(ids).logits
        got = actor.to(torch.bfloat16)(ids).logits
    assert torch.equal(got, want)


def test_patch_actor_with_the_hf_profile_is_the_stock_baseline():
    """ROUNDALIGN_PROFILE=hf (stock numerics, e.g. a baseline run) patches nothing and must not be taken for a miss."""
    actor = _fp32_actor()
    report = patch_actor(actor, "hf")
    assert report.profile == "hf" and report.aligned_modules == 0
    assert not any(hasattr(type(m), "_roundalign_hf_class") for m in actor.modules())


def test_patch_actor_refuses_unsupported_and_unreached():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        patch_actor(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2")))
    actor = _fp32_actor()
    actor.model.norm.__dict__["forward"] = lambda x: x  # someone else's instance forward: not Liger's, kept
    with pytest.raises(RuntimeError, match="model.norm"):
        patch_actor(actor, "vllm")


def test_write_rollout_logprobs_unpads_a_verl_batch(tmp_path):
    from roundalign.integrations.verl import write_rollout_logprobs
    from roundalign.rollouts import read_engine_logprobs

    batch = {  # verl's layout: left-padded prompts, right-padded responses, one attention_mask over both
        "prompts": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
        "responses": torch.tensor([[11, 12, 0], [13, 0, 0]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]]),
        "rollout_log_probs": torch.tensor([[-0.5, -0.25, 0.0], [-1.5, 0.0, 0.0]]),
    }
    assert write_rollout_logprobs(batch, tmp_path / "dump.jsonl") == 2
    got = read_engine_logprobs(tmp_path / "dump.jsonl", vocab_size=264, max_model_len=256)
    assert [(r.prompt_token_ids, r.token_ids, r.logprobs) for r in got] == [
        ([5, 6], [11, 12], [-0.5, -0.25]),
        ([7, 8, 9, 10], [13], [-1.5]),
    ]
    with pytest.raises(KeyError, match="calculate_log_probs"):
        write_rollout_logprobs({k: v for k, v in batch.items() if k != "rollout_log_probs"}, tmp_path / "x.jsonl")


# ---- activation -----------------------------------------------------------------------------------------------------


def test_settings_from_env_and_runtime_env():
    assert settings_from_env({}) is None
    env = {"ROUNDALIGN_PROFILE": "vllm", "ROUNDALIGN_SYNC": "stochastic", "ROUNDALIGN_SYNC_SEED": "5"}
    got = settings_from_env(env)
    assert (got["profile"].name, got["sync"], got["seed"]) == ("vllm", "stochastic", 5)
    with pytest.raises(ValueError, match="ROUNDALIGN_SYNC='sr'"):
        settings_from_env({"ROUNDALIGN_SYNC": "sr"})
    with pytest.raises(ValueError, match="not an integer"):
        settings_from_env({"ROUNDALIGN_SYNC": "stochastic", "ROUNDALIGN_SYNC_SEED": "x"})
    with pytest.raises(ValueError, match="only seeds"):
        settings_from_env({"ROUNDALIGN_SYNC": "error-feedback", "ROUNDALIGN_SYNC_SEED": "1"})
    with pytest.raises(ValueError, match="unknown profile|vllm"):
        settings_from_env({"ROUNDALIGN_PROFILE": "vllm-typo"})
    env = ray_runtime_env({"env_vars": {"A": "1"}}, environ={"ROUNDALIGN_PROFILE": "vllm", "ROUNDALIGN_SYNC": ""})
    assert env == {"env_vars": {"A": "1", "ROUNDALIGN_PROFILE": "vllm"}, "worker_process_setup_hook": SETUP_HOOK}
    with pytest.raises(ValueError, match="one hook per worker"):
        ray_runtime_env({"worker_process_setup_hook": "mine.setup"}, environ={})


_ACTIVATION_SCRIPT = """
import roundalign.integrations.verl as rv
assert rv.activate() is not None and rv.installed() is None  # armed, not installed: verl's engine not imported yet
import verl.workers.engine.fsdp.transformer_impl as ti  # what a verl worker imports when it builds the actor
print(rv.installed()["profile"].name, rv.installed()["sync"], ti.apply_monkey_patch.__module__,
      ti.FSDPEngine.get_per_tensor_param_shard.__module__)
from roundalign.integrations.verl import main_ppo
main_ppo.prepare()
import verl.trainer.main_ppo as vm
env = vm.get_ppo_ray_runtime_env()
print(env["worker_process_setup_hook"], env["env_vars"]["ROUNDALIGN_SYNC"])
"""


@pytest.mark.slow
def test_activation_installs_on_import_and_main_ppo_adds_the_ray_hook():
    require_verl()
    env = dict(os.environ, ROUNDALIGN_PROFILE="vllm", ROUNDALIGN_SYNC="stochastic", ROUNDALIGN_SYNC_SEED="3")
    out = subprocess.run(
        [sys.executable, "-c", _ACTIVATION_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == ("vllm stochastic roundalign.integrations.verl.hooks roundalign.integrations.verl.hooks")
    assert lines[-1] == f"{SETUP_HOOK} stochastic"


_RAY_SCRIPT = """
import os
import ray
from roundalign.integrations.verl import ray_runtime_env
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
         runtime_env=ray_runtime_env({"env_vars": {"JOB_VAR": "1"}}))

@ray.remote
class Worker:  # like verl's workers: an actor with a runtime_env of its own
    def state(self):
        import roundalign.integrations.verl as rv
        import verl.workers.engine.fsdp.transformer_impl as ti
        return (os.environ.get("ROUNDALIGN_PROFILE"), os.environ.get("JOB_VAR"), os.environ.get("ACTOR_VAR"),
                rv.installed()["profile"].name, ti.apply_monkey_patch.__module__)

print(ray.get(Worker.options(runtime_env={"env_vars": {"ACTOR_VAR": "2"}}).remote().state.remote()))
ray.shutdown()
"""


@pytest.mark.slow
def test_ray_workers_get_the_variables_and_run_the_setup_hook():
    require_verl()
    env = dict(os.environ, ROUNDALIGN_PROFILE="vllm")
    out = subprocess.run([sys.executable, "-c", _RAY_SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = out.stdout.strip().splitlines()[-1]
    assert got == "('vllm', '1', '2', 'vllm', 'roundalign.integrations.verl.hooks')"


def test_install_turns_hub_kernels_off_and_uninstall_restores_the_variable(monkeypatch):
    """verl builds the actor on the meta device on every rank but the first; transformers >= 5.25 kernelizes in
    from_pretrained by default, and the kernels library refuses a meta-device model. The hooks set transformers' own
    switch while installed."""
    require_verl()
    import accelerate

    import roundalign.integrations.verl as rv

    monkeypatch.setenv("USE_HUB_KERNELS", "no")
    rv.uninstall()
    try:
        rv.install(profile="vllm")
        assert os.environ["USE_HUB_KERNELS"] == "0"
        with accelerate.init_empty_weights():  # what verl's get_init_weight_context_manager does off rank 0
            model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert not model.use_kernels
    finally:
        rv.uninstall()
    assert os.environ["USE_HUB_KERNELS"] == "no"
    monkeypatch.delenv("USE_HUB_KERNELS")
    rv.install()
    rv.uninstall()
    assert "USE_HUB_KERNELS" not in os.environ
    monkeypatch.setenv("USE_HUB_KERNELS", "1")
    with pytest.warns(UserWarning, match="USE_HUB_KERNELS='1'.*set it to 0"):
        rv.install()
    rv.uninstall()
    assert os.environ["USE_HUB_KERNELS"] == "1"


# ---- verl's real FSDPEngine on 2 gloo ranks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actor_runs():
    require_verl()
    from tests.distributed import spawn_gloo
    from tests.verl_ranks import actor_run

    return spawn_gloo(actor_run, 2, 3, 1e-6, 7)  # 3 optimizer steps at lr 1e-6, stochastic seed 7


def _bf16_reference(profile):
    from tests.verl_ranks import token_batch

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16, attn_implementation="sdpa")
    if profile is not None:
        roundalign.apply(model, profile)
    with torch.no_grad():
        return model(token_batch()).logits


@pytest.mark.slow
def test_verl_fsdp2_actor_logits_match_the_bf16_model(actor_runs):
    for rank0, rank1 in zip(*actor_runs, strict=True):
        want = _bf16_reference(rank0["profile"])
        assert torch.equal(rank0["logits"], rank1["logits"])
        assert torch.equal(rank0["logits"], want), (rank0["profile"], rank0["sync"])
        assert torch.equal(rank0["logits_autocast"], want)  # under verl's forward_step autocast too
        if rank0["profile"] is not None:
            assert rank0["layer_class"] == "FSDPAlignedQwen3DecoderLayer"  # wrapped per layer, by the aligned name
            assert rank0["report"].aligned_modules == 30


@pytest.mark.slow
def test_verl_weight_sync_exports_match_full_tensor_reference(actor_runs):
    for rank0, rank1 in zip(*actor_runs, strict=True):
        assert rank0["mismatches"] == [] and rank1["mismatches"] == [], (rank0["sync"], rank0["mismatches"][:3])
        for (local0, changed), (local1, _) in zip(rank0["changed"], rank1["changed"], strict=True):
            assert local0 + local1 == changed  # verl's sparse delta counts exactly the served bits that moved


@pytest.mark.slow
def test_stochastic_sync_makes_verl_deltas_denser(actor_runs):
    density = {(r["profile"], r["sync"]): [c / r["total"] for _, c in r["changed"]] for r in actor_runs[0]}
    rne, sr, ef = density[("vllm", None)], density[("vllm", "stochastic")], density[("vllm", "error-feedback")]
    assert all(s > 2 * r for s, r in zip(sr, rne, strict=True))
    assert ef[-1] > rne[-1] and sr[-1] > ef[-1]


@pytest.mark.slow
def test_verl_fp8_rollouts_get_verls_own_fp8_weights_in_the_aligned_trainer():
    """verl's FP8 rollouts (blockwise E4M3, 128 x 128 weight scales): on two FSDP2 ranks, at the seed sync and after
    each optimizer step, the FP8 weights and descales the aligned trainer (``vllm+quantization=fp8-block``) computes
    with are bit for bit what verl's own quantizer makes of the exported weights, for every linear it quantizes; and
    the actor's logits are the single-process model's under the same profile."""
    require_verl()
    from tests.distributed import spawn_gloo
    from tests.verl_ranks import fp8_run

    ranks = spawn_gloo(fp8_run, 2, 2, 1e-4)  # 2 optimizer steps at lr 1e-4: the weights move
    want = _bf16_reference("vllm+quantization=fp8-block")
    for rank in ranks:
        for version in rank:
            assert version["mismatches"] == [] and version["dtype"] == "torch.float8_e4m3fn"
            assert version["verl"] == version["ours"] and len(version["ours"]) == 4 * 7  # 4 layers x 7 projections
        assert torch.equal(rank[0]["logits"], want)
        assert not torch.equal(rank[-1]["logits"], want)  # the steps moved the weights: the check saw new codes


# ---- verl's whole loop on a CPU: the pieces (tests/test_verl_loop.py runs the loop itself) -------------------------


def test_the_actors_log_probs_are_the_samplers_formula_not_verls():
    """verl's ``logprobs_from_logits`` (``x - logsumexp(x)`` on fp32 logits, ``log_softmax`` in bf16 on bf16 ones) and
    its bf16 temperature division differ from the sampler's in low bits; the hook computes vLLM's formula:
    ``log_softmax(float(logits) / T)`` (vllm/v1/sample/sampler.py), restated here as the reference."""
    require_verl()
    from verl.utils.torch_functional import logprobs_from_logits as verls

    from roundalign.integrations.verl.logprobs import logprobs_from_logits, scale_logits_by_temperature

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 300, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 300, (64,), generator=g)
    for t in (1.0, 0.7):
        want = (logits.float() / t).log_softmax(-1).gather(-1, labels[:, None])[:, 0]
        temperature = torch.full((64, 1), t)
        scaled = scale_logits_by_temperature(logits, temperature, is_unit_temperature=t == 1.0)
        assert torch.equal(logprobs_from_logits(scaled, labels), want)
        verl_scaled = logits if t == 1.0 else logits / temperature.to(logits.dtype)  # verl 0.9.1's scaling
        assert not torch.equal(verls(verl_scaled.float(), labels), want)  # why the hook exists
    # the gradient flows (the actor's update goes through the hooked head)
    x = logits.float().requires_grad_()
    logprobs_from_logits(x, labels).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_cpu_platform_is_chosen_only_by_name(monkeypatch):
    require_verl()
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from roundalign.integrations.verl import cpu

    cpu.register()
    platform = PlatformRegistry.get("cpu")()
    assert not platform.is_platform_available(use_smi_check=True)  # a GPU machine keeps verl's own choice
    assert (platform.device_name, platform.communication_backend_name(), platform.is_ipc_supported()) == (
        "cpu", "gloo", False,
    )  # fmt: skip
    device = platform.current_device()
    assert f"{platform.device_name}:{device}" == "cpu:0" and torch.device(device).type == "cpu"
    assert torch.zeros(1).to(device).device.type == "cpu"
    module = platform.device_module
    assert module.memory_reserved() == 0 and module.mem_get_info()[1] > 0 and module.is_available()
    env = cpu.environment({"VERL_USE_EXTERNAL_MODULES": "my.plugin"})
    assert env["VERL_USE_EXTERNAL_MODULES"] == "my.plugin,roundalign.integrations.verl.cpu"
    assert env["VERL_PLATFORM"] == "cpu" and cpu.active(env) and not cpu.active({})


def test_after_import_runs_once_the_module_has_executed(tmp_path, monkeypatch):
    from roundalign.integrations.verl.imports import after_import

    (tmp_path / "ra_after_import_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("ra_after_import_probe", lambda m: seen.append(m.VALUE + 1))
    assert seen == []
    import ra_after_import_probe  # noqa: F401

    assert seen == [42]
    after_import("ra_after_import_probe", lambda m: seen.append(m.VALUE))  # imported already: at once
    assert seen == [42, 41]
    sys.modules.pop("ra_after_import_probe")


_FSDP2_LM_HEAD = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
import roundalign
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
plain = roundalign.apply(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16), "vllm-reference-kernels")
sharded = roundalign.apply(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16), "vllm-reference-kernels")
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded.lm_head)  # verl shards the lm_head as its own unit: its class becomes FSDPEngineLMHead
fully_shard(sharded)
print(type(sharded.lm_head).__name__)
with torch.no_grad():
    assert torch.equal(plain(input_ids=ids).logits, sharded(input_ids=ids).logits)
print("equal")
"""


def test_engine_gemm_runs_on_an_fsdp2_sharded_lm_head(tmp_path):
    """FSDP2 swaps a module's class for ``FSDP<class>``; the engine GEMM must still see a plain linear there."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = f"MODEL = {str(MODEL)!r}\n" + _FSDP2_LM_HEAD
    env = dict(os.environ, PORT=str(port), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["FSDPEngineLMHead", "equal"]
