"""parallel.plan=auto: the plan it picks, why (a paragraph, recorded), and that the picked plan is what trains."""

from __future__ import annotations

import json

import pytest
import yaml
from quick_fit import QUICK_FIT

from hslite.errors import ConfigError
from hslite.parallel.box import startable_devices
from hslite.parallel.plan import Plan
from hslite.preflight_check.decide.verdict import decide
from hslite.preflight_check.price.costmodel import Prediction
from hslite.recipe.auto_plan import choose_plan, explain, fewest_devices_near_best
from hslite.recipe.build import config_for_plan, plan_from_config
from hslite.recipe.config import load_config

QUICK = [*QUICK_FIT, "data.eval_batch_size=128", "train.limit_test_batches=2", "output.save_checkpoint=false"]
REQUESTED = Plan(batch_size=64)  # quickstart's own layout
FASTER = Plan(batch_size=32, accumulate=2)  # what auto should train
SPLITS_BANDS = Plan(devices=2, batch_size=64, chag=2)  # fastest of all, but the 1-D CNN has no band groups to split


def prediction(plan: Plan, step_seconds: float, fits: bool = True) -> Prediction:
    samples = plan.global_batch / step_seconds
    return Prediction(
        step_seconds=step_seconds, compute_seconds=step_seconds, loop_seconds=0.0, comm_seconds=0.0,
        samples_per_second=samples, ecd=samples / plan.world_size, per_device_peak_bytes=3 * 2**20, fits_memory=fits,
        speedup=1.0, chag_bytes_per_step=0, grad_bytes_per_step=0.0, r=0.0, memory_budget_bytes=2**30,
    )  # fmt: skip


def priced(step_seconds: dict[Plan, float], too_big: tuple[Plan, ...] = ()):
    """A stand-in for preflight_check: these prices, decided for the requested plan; it checks what auto asks for."""
    asked = {}

    def preflight_check(cfg, plan, datamodule, *, max_devices=None, **kwargs):
        asked.update(plan=plan, max_devices=max_devices, **kwargs)
        predictions = {p: prediction(p, s, fits=p not in too_big) for p, s in step_seconds.items()}
        return decide(plan, predictions, cfg.preflight.min_efficiency)

    return preflight_check, asked


def test_the_config_of_a_plan_loads_back_as_that_plan_and_says_manual():
    cfg = load_config("quickstart_cpu2", ["parallel.plan=auto"])
    for plan in (FASTER.with_(accelerator="cpu"), Plan(devices=4, batch_size=16, compression="int8"), SPLITS_BANDS):
        written = config_for_plan(cfg, plan)
        assert plan_from_config(written) == plan and written.parallel.plan == "manual"
    with pytest.raises(ConfigError, match="one of 'manual', 'auto'"):
        load_config("quickstart", ["parallel.plan=fastest"])


def test_auto_trains_the_fastest_passing_plan_the_model_can_run_and_records_why(tmp_path, monkeypatch, capsys):
    from hslite.recipe import auto_plan
    from hslite.run.fit import fit

    fake, asked = priced(
        {REQUESTED: 0.010, FASTER: 0.008, SPLITS_BANDS: 0.001, Plan(batch_size=16, accumulate=4): 0.0092}
    )
    monkeypatch.setattr(auto_plan, "preflight_check", fake)
    result = fit(load_config("quickstart", [*QUICK, "parallel.plan=auto", f"output.root={tmp_path}"]))
    assert asked["plan"] == REQUESTED and asked["max_devices"] == startable_devices("cpu")  # every count fit can start
    assert not asked.get("single_device_only")  # a one-device recipe still prices the other layouts

    assert result.plan == FASTER and result.metrics["plan"] == FASTER.to_dict()  # what trained is what was chosen
    config = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert config["data"]["batch_size"] == 32 and config["parallel"]["accumulate"] == 2
    assert config["parallel"]["plan"] == "manual"  # loading the run's config again trains the same plan
    choice = json.loads((result.run_dir / "plan_choice.json").read_text())
    assert choice["chosen"] == FASTER.describe() and choice["search"]["requested"] == REQUESTED.describe()
    assert choice["paragraph"] in capsys.readouterr().out
    assert f"It trains {FASTER.describe()}, the fastest of them" in choice["paragraph"]
    assert "priced 3 plans" in choice["paragraph"]  # the band-group plan the 1-D CNN cannot split is left out
    assert f"own {REQUESTED.describe()} is predicted 1.25× slower" in choice["paragraph"]
    assert "1×cpu dp1 b16 acc4 32-true, is predicted 15% slower" in choice["paragraph"]
    preflight = json.loads((result.run_dir / "preflight.json").read_text())
    assert preflight["requested"] == FASTER.describe() and preflight["go"] is True
    assert preflight["measured"]["predicted_step_seconds"] == pytest.approx(0.008)


def test_auto_skips_plans_that_do_not_fit_and_keeps_the_recipes_plan_when_it_is_best(monkeypatch):
    from hslite.recipe import auto_plan

    fake, _ = priced({REQUESTED: 0.010, FASTER: 0.008}, too_big=(FASTER,))
    monkeypatch.setattr(auto_plan, "preflight_check", fake)
    choice = choose_plan(load_config("quickstart", [*QUICK, "parallel.plan=auto"]))
    assert choice.plan == REQUESTED and choice.cfg.data.batch_size == 64
    assert "It is the layout the recipe asks for." in choice.paragraph and "1 fit in memory" in choice.paragraph


def test_auto_needs_the_preflight_of_this_box():
    refusals = {"preflight.enabled=false": "drop preflight.enabled=false", "preflight.topology=nvlink_8": "this box"}
    for extra, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            choose_plan(load_config("quickstart", [*QUICK, "parallel.plan=auto", extra]))


def test_the_paragraph_names_what_was_priced_and_why_the_recipes_plan_lost():
    ddp = Plan(devices=2, batch_size=32)
    steps = {REQUESTED: 0.010, ddp.with_(compression="int8"): 0.030, ddp: 0.040}
    search = decide(ddp, {plan: prediction(plan, seconds) for plan, seconds in steps.items()})
    text = explain(search, REQUESTED, 4)
    assert text.startswith("parallel.plan=auto priced 3 plans for the recipe's global batch of 64 on 1 to 4 CPU")
    assert "(one device, data parallelism, compressed all-reduce); 1 fit in memory and pass the gate" in text
    assert f"own {ddp.describe()} is predicted 4.00× slower per step (its pre-flight: NO-GO, predicted" in text


def test_more_devices_must_be_predicted_clearly_faster_to_be_chosen():
    ddp = Plan(devices=2, batch_size=32)
    for ddp_seconds, chosen in ((0.0095, REQUESTED), (0.0080, ddp)):  # 5 % and 25 % more throughput on 2 devices
        search = decide(REQUESTED, {REQUESTED: prediction(REQUESTED, 0.010), ddp: prediction(ddp, ddp_seconds)}, 0.1)
        assert search.best_passing == ddp
        assert fewest_devices_near_best(search) == chosen
    search = decide(REQUESTED, {REQUESTED: prediction(REQUESTED, 0.010), ddp: prediction(ddp, 0.0095)}, 0.1)
    text = explain(search, REQUESTED, 2)
    assert f"It trains {REQUESTED.describe()}, the plan on the fewest devices within 10% of the fastest" in text
    assert f"The fastest, {ddp.describe()}, is predicted only 5% faster on 2 devices" in text
