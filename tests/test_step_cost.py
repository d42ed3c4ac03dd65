"""The step-cost model (pdcommon.step_cost), `pdserve profile`, and the token budget a profile
chooses through the config."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdcommon.config import load_config
from pdcommon.process_env import MALLOC_TUNABLES, PREFILL_SPIN_COUNT, engine_process_env
from pdcommon.step_cost import StepCostModel, StepSample

ROOT = Path(__file__).resolve().parent.parent

# A made-up machine: flat (bandwidth-bound) up to 64 tokens, then linear; plus per-sequence and
# attention costs. The fit must recover it from samples shaped like `pdserve profile`'s.
TRUE = StepCostModel(knots=[1, 64, 4096], knot_seconds=[0.010, 0.012, 0.500], prefill_attention_s=2e-8,
                     decode_attention_s=3e-7, sequence_s=2e-4)


def _samples() -> list[StepSample]:
    shapes = [([(n, n)], []) for n in (16, 32, 64, 128, 256, 512, 1024, 2048)]
    shapes += [([(n // 4, n // 4)] * 4, []) for n in (256, 512, 1024, 2048)]
    shapes += [([], [ctx] * b) for ctx in (36, 516) for b in (1, 2, 4, 8, 16, 32, 64)]
    return [StepSample(p, d, TRUE.step_seconds(p, d)) for p, d in shapes]


def test_fit_recovers_the_costs_and_predicts_mixed_steps():
    model = StepCostModel.fit(_samples(), kv_capacity_tokens=1000)
    assert model.fit_error() < 1e-6
    assert model.sequence_s == pytest.approx(TRUE.sequence_s, rel=1e-3)
    assert model.prefill_attention_s == pytest.approx(TRUE.prefill_attention_s, rel=1e-3)
    assert model.decode_attention_s == pytest.approx(TRUE.decode_attention_s, rel=1e-3)
    # Steps it never saw: a prompt chunk beside a decode batch, a chunk after cached context.
    for prefills, decodes in (([(256, 256)], [512] * 8), ([(512, 1536)], [100] * 3), ([(3000, 3000)], [])):
        assert model.step_seconds(prefills, decodes) == pytest.approx(TRUE.step_seconds(prefills, decodes), rel=1e-3)
    assert model.prefill_seconds(1024, chunk=256) > model.prefill_seconds(1024)  # four weight passes, not one
    assert model.prefill_seconds(1024, cached=512) < model.prefill_seconds(1024)


def test_fit_with_noise_keeps_costs_non_negative():
    noisy = [StepSample(s.prefills, s.decodes, s.seconds * (1.3 if i % 3 == 0 else 0.8))
             for i, s in enumerate(_samples())]
    model = StepCostModel.fit(noisy)
    assert min(model.sequence_s, model.prefill_attention_s, model.decode_attention_s) >= 0
    assert model.knot_seconds == sorted(model.knot_seconds)  # more tokens never cost less


def test_budget_meets_the_target_and_keeps_prefill_efficient():
    budgets = []
    for target in (0.05, 0.1, 0.2, 0.4):
        budget, why = TRUE.choose_budget(target, decode_batch=8, decode_context=512)
        chunk = budget - 8
        assert TRUE.step_seconds([(chunk, chunk)], [512] * 8) <= target, why
        assert TRUE.step_seconds([(chunk + 16, chunk + 16)], [512] * 8) > target, why  # and it is the largest
        budgets.append(budget)
    assert budgets == sorted(budgets) and len(set(budgets)) == len(budgets)
    # Below what one decode step costs, the budget falls back to the efficient floor, and says so.
    budget, why = TRUE.choose_budget(0.001, decode_batch=8, decode_context=512)
    assert budget - 8 >= 16 and "cannot meet" in why
    throughput = [(p, p / TRUE.step_seconds([(p, p)])) for p in range(16, 16385, 16)]
    assert budget - 8 == next(p for p, t in throughput if t >= 0.5 * max(t for _, t in throughput))


def test_profile_file_round_trip_and_errors(tmp_path):
    model = StepCostModel.fit(_samples(), kv_capacity_tokens=123, meta={"threads": 2})
    path = tmp_path / "p.json"
    model.save(path)
    back = StepCostModel.load(path)
    assert back.step_seconds([(100, 100)], [50] * 3) == model.step_seconds([(100, 100)], [50] * 3)
    assert back.kv_capacity_tokens == 123 and back.meta == {"threads": 2}
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not a step-cost profile"):
        StepCostModel.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="cannot read"):
        StepCostModel.load(tmp_path / "missing.json")


def _colocated_yaml(tmp_path, model: str, extra: str = "") -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {model}\nmode: colocated\nengine:\n  num_threads: 1\n{extra}")
    return p


def _profile_for(stories_path: str, tmp_path) -> Path:
    from engine.model_meta import model_spec, read_json

    spec = model_spec(read_json(Path(stories_path) / "config.json"), Path(stories_path))
    model = StepCostModel.fit(_samples(), meta={"hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                                                "vocab_size": spec.vocab_size, "threads": 1})
    path = tmp_path / "profile.json"
    model.save(path)
    return path


def test_config_takes_the_budget_from_the_profile(tmp_path, stories_path):
    prof = _profile_for(stories_path, tmp_path)
    got = {}
    for target in (50, 200):
        cfg = load_config(_colocated_yaml(tmp_path, stories_path, f"scheduling:\n  profile: {prof}\n"
                                          f"  target_step_ms: {target}\n"))
        got[target] = cfg.engine_config("colocated").max_num_batched_tokens
        assert got[target] == TRUE.choose_budget(target / 1e3, 8, 512)[0]
    assert got[50] < got[200]
    # The dump that travels to Ray actors carries the number itself, not the file.
    assert cfg.model_dump()["colocated"]["engine"]["max_num_batched_tokens"] == got[200]


def test_config_profile_errors(tmp_path, stories_path):
    prof = _profile_for(stories_path, tmp_path)
    both = f"scheduling:\n  profile: {prof}\n  target_step_ms: 50\n"
    with pytest.raises(ValueError, match="not both"):
        load_config(_colocated_yaml(tmp_path, stories_path, both + "colocated:\n  engine:\n"
                                    "    max_num_batched_tokens: 512\n"))
    with pytest.raises(ValueError, match="give both"):
        load_config(_colocated_yaml(tmp_path, stories_path, f"scheduling:\n  profile: {prof}\n"))
    other = StepCostModel.load(prof)
    other.meta["hidden_size"] = 4096
    other.save(tmp_path / "other.json")
    with pytest.raises(ValueError, match="another model"):
        load_config(_colocated_yaml(tmp_path, stories_path, both.replace(str(prof), str(tmp_path / "other.json"))))
    with pytest.warns(UserWarning, match="disaggregated"):
        cfg = load_config(None, model=stories_path, **{"scheduling.profile": str(prof),
                                                        "scheduling.target_step_ms": 50})
    assert cfg.engine_config("prefill").max_num_batched_tokens == 2048


def test_engine_process_env_keeps_the_users_tunables():
    env = engine_process_env(2, base={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1:glibc.foo=2"})
    assert env["OMP_NUM_THREADS"] == "2"
    items = env["GLIBC_TUNABLES"].split(":")
    assert "glibc.malloc.mmap_threshold=1" in items and "glibc.foo=2" in items
    assert f"glibc.malloc.trim_threshold={MALLOC_TUNABLES['glibc.malloc.trim_threshold']}" in items
    assert "GLIBC_TUNABLES" not in engine_process_env(1, tune_malloc=False, base={})


def test_only_a_prefill_worker_s_openmp_helpers_spin_briefly():
    """GOMP_SPINCOUNT (process_env.PREFILL_SPIN_COUNT): for prefill workers with helper threads,
    unless the user set it; decode and colocated workers keep GNU OpenMP's default."""
    assert engine_process_env(2, base={}, role="prefill")["GOMP_SPINCOUNT"] == PREFILL_SPIN_COUNT
    for role in ("decode", "colocated", ""):
        assert "GOMP_SPINCOUNT" not in engine_process_env(2, base={}, role=role)
    assert "GOMP_SPINCOUNT" not in engine_process_env(1, base={}, role="prefill")  # no helpers
    assert "GOMP_SPINCOUNT" not in engine_process_env(2, base={"GOMP_SPINCOUNT": "7"}, role="prefill")


def test_the_process_launcher_starts_each_pool_with_its_env(monkeypatch, stories_path):
    """What `pdserve up --launcher process` hands its children (the command is not run here)."""
    from pdserve.launch import processes

    started: dict[str, dict] = {}

    class Child:
        def __init__(self, cmd: list[str], env: dict, **_) -> None:
            started[cmd[3]] = env  # [python, -m, pdserve.cli, ROLE, ...]
            self.stdin = io.StringIO()

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(processes.subprocess, "Popen", Child)
    cfg = load_config(None, model=stories_path, **{"engine.num_threads": 2})
    launcher = processes.ProcessLauncher(cfg, "127.0.0.1:1")
    for role in ("prefill", "decode"):
        asyncio.run(launcher.add_worker(role))
    assert started["prefill"]["GOMP_SPINCOUNT"] == PREFILL_SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in started["decode"]
    assert started["prefill"]["OMP_NUM_THREADS"] == started["decode"]["OMP_NUM_THREADS"] == "2"


def test_pdserve_profile_on_a_real_engine(tmp_path, stories_path):
    """The real command line, as a user runs it: it restarts itself with the malloc tunables,
    measures stories260K, and writes a profile that loads and predicts what it measured."""
    out = tmp_path / "prof.json"
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PDSERVE_REEXEC")}
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "profile", "--config", str(ROOT / "configs/local.yaml"),
                        "--model", stories_path, "--out", str(out), "--max-prompt", "256", "--max-batch", "8",
                        "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fit: median error" in r.stdout
    model = StepCostModel.load(out)
    assert out.with_suffix(".png").stat().st_size > 10_000
    for k, v in MALLOC_TUNABLES.items():
        assert f"{k}={v}" in model.meta["glibc_tunables"].split(":")
    assert model.kv_capacity_tokens > 0 and model.knots[-1] >= 256
    # float32 on the CPU: the default layout, recorded with the routes it measured
    assert model.meta["cpu_gemm"] == "auto" and model.meta["gemm_routes"]
    assert {len(s["decodes"]) for s in model.samples} >= {0, 1, 2, 4, 8}
    assert model.fit_error() < 0.5  # a shared noisy machine: loose, but a broken fit is off by far more
    # The hit sweep: real prefix-cache hits (the profiler checks the engine's own count of cached
    # tokens), the computed part attending to the whole prompt.
    hits = model.meta["prefix_hits"]
    assert [h["prefills"] for h in hits] == [[[128, 256]], [[64, 256]], [[32, 256]]]
    assert all(h["predicted"] > 0 for h in hits)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_the_transfer_profile_sends_real_kv_and_fits_it(transport):
    """`pdserve profile --transfer`'s measurement: real transfers of each size, checked and landed
    by a receiver thread, and a fit whose costs are positive and predict the sizes it measured."""
    from pdserve.profile_transfer import measure_transfer

    got = measure_transfer(transport, 1280, 16, tokens=(16, 256, 2048), repeats=2)
    assert [p["bytes"] for p in got["points"]] == [1280 * 16, 1280 * 256, 1280 * 2048]
    assert got["bytes_per_s"] > 0 and got["fixed_s"] >= 0
    biggest = got["points"][-1]
    predicted = got["fixed_s"] + biggest["bytes"] / got["bytes_per_s"]
    assert 0.2 < predicted / biggest["seconds"] < 5  # a fit of these points, not a constant
