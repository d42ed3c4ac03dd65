"""The planner's decode model against the simulator, near the TPOT knee.

For Poisson loads of one length mix, and decode pools around the size where TPOT attainment
falls off, it prints and writes (JSON) three figures per pool size:
- `simulated`: the TPOT attainment the simulator serves with that many decode workers (the
  prefill pool large enough to keep TTFT out of it);
- `model`: what the planner's decode model (router/planner/sizing.py) predicts, uncorrected;
- `model_corrected`: the same with the decode correction the SLA planner learns when it serves
  `--light-rate` for `--light-s` with its pools pinned (its observed against predicted ITL).

The simulator runs the shipped profile, so any correction away from 1 is the model's own
error. Uncorrected, the model mostly errs on the safe side at the knee (1024 / 128 tokens, 6
req/s, 8 workers: 0.900 against 0.890 served; 10.4 req/s, 13 workers: 0.543 against 0.808, the
worst). The correction is learnt from each request's TPOT at the batch its decode worker says
it rode, and comes out at 1.000. It was guessed before, as 1 + the pool's mean batch by
Little's law; at light load the router's least-loaded placement lets most sequences decode
alone, so the guess counted company they did not have and learnt 0.876 at 2 req/s, which then
predicted 1.000 at 8 workers and 0.997 at 7, where 0.514 was served (10.4 req/s, 12 workers:
1.000 against 0.501): the planner's diurnal shortfall (87.5% of a 90% target).

Run: .venv/bin/python bench/decode_model.py [--rates 3,6,10.4] [--prompt 1024 --output 128]
     [--out bench/out/decode_model.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdcommon.config import PlannerSection, PoolLimits  # noqa: E402
from pdcommon.step_cost import StepCostModel  # noqa: E402
from pdserve.sim.cluster import SimSettings  # noqa: E402
from pdserve.sim.command import default_profile  # noqa: E402
from pdserve.sim.search import pool_model, run_planner, simulate  # noqa: E402
from pdserve.sim.traces import poisson  # noqa: E402
from router.planner import Slos, StaticPlanner  # noqa: E402
from router.planner.base import Arrival  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def learnt_correction(settings: SimSettings, rate: float, seconds: float, split: dict[str, int],
                      prompt: int, output: int) -> float:
    """The decode correction of an SLA planner that served `rate` with its pools pinned."""
    pinned = {p: PoolLimits(min_replicas=n, max_replicas=n) for p, n in split.items()}
    cfg = PlannerSection(mode="sla", profile=str(default_profile()), **pinned)
    reqs = poisson(rate, max(50, round(rate * seconds)), prompt, output, seed=1)
    result, _ = run_planner(reqs, settings, cfg, dict(split))
    return result.decisions[-1].inputs["correction"]["decode"] if result.decisions else 1.0


def rows_for(settings: SimSettings, rate: float, prompt: int, output: int, correction: float) -> list[dict]:
    pm, dm = pool_model(settings)
    sample = [Arrival(prompt, output, 0, k / rate) for k in range(600)]
    dm.hold_s = pm.terms(sample).service_mean
    terms = dm.terms(sample)
    prefill = max(2, math.ceil(4 * rate * settings.profile.prefill_seconds(prompt)))
    # The model's own fewest workers, and the sizes about it.
    centre = next(w for w in range(1, 1000) if dm.decode_attainment(w, rate, terms) >= 0.9)
    out = []
    for w in range(max(1, centre - 3), centre + 4):
        split = {"prefill": prefill, "decode": w}
        _, got = simulate(poisson(rate, 3000, prompt, output, seed=0), settings, StaticPlanner(split), split)
        out.append({"rate": rate, "decode": w, "simulated": got["tpot_attainment"],
                    "model": dm.decode_attainment(w, rate, terms),
                    "model_corrected": dm.decode_attainment(w, rate, terms, correction)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="3,6,10.4")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--light-rate", type=float, default=2.0)
    ap.add_argument("--light-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=OUT / "decode_model.json")
    args = ap.parse_args()
    profile = StepCostModel.load(default_profile())
    settings = SimSettings(profile=profile, mode="disaggregated", slos=Slos(None, None, 3.0, 2.0))
    correction = learnt_correction(settings, args.light_rate, args.light_s, {"prefill": 4, "decode": 6},
                                   args.prompt, args.output)
    print(f"decode correction learnt at {args.light_rate} req/s: {correction:.3f}")
    rows = []
    for rate in (float(x) for x in args.rates.split(",")):
        for r in rows_for(settings, rate, args.prompt, args.output, correction):
            rows.append(r)
            print(f"{rate:5.1f} req/s, {r['decode']:3d} decode: simulated {r['simulated']:.3f}, model "
                  f"{r['model']:.3f}, corrected {r['model_corrected']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompt": args.prompt, "output": args.output, "light_rate": args.light_rate,
                                    "correction": correction, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
