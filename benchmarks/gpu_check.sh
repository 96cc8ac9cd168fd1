#!/usr/bin/env bash
# The pre-flight on a GPU box, predicted against measured, in under 8 minutes:
#
#   bash benchmarks/gpu_check.sh             # 1..N CUDA devices: probe + NCCL links, then short fits
#   bash benchmarks/gpu_check.sh --dry-run   # same sequence on CPU (gloo, 1-2 processes, tiny settings)
#
# Steps, each under `timeout`:
#   1 environment   versions, visible devices; `pip install -e .` only when hslite does not import
#   2 pre-flight    `hslite preflight --json` for all visible devices: probe on device 0, NCCL all-reduce links
#                   (gloo on --dry-run), every candidate plan priced -> preflight.json (exit 3 = NO-GO is a result)
#   3 fits          short `hslite fit` runs: devices 1 and all visible × precision 32-true, bf16-mixed × accumulate
#                   1, 4 (on --dry-run one factor at a time from 1 process, fp32, acc 1, to stay near a minute);
#                   each run folder's preflight.json holds the predicted beside the measured step time
#   4 summary       predicted vs measured step seconds, relative error, predicted E and verdict, measured samples/s
#   5 profile       the same plans priced from this GPU's device profile (hslite/preflight/devices/, roofline of
#                   DESIGN §3) beside the fits' measured step time: the profile's error, what pricing a box you do
#                   not have would get wrong (on --dry-run the h100_sxm profile against CPU fits: the error means
#                   nothing there, the step only shows the path runs)
# Outputs under $OUT when set, else ./gpu_check_out: environment.txt, preflight.json, summary.txt, profile.txt,
# steps.log (every command's output) and runs/ (the fits' run folders). Overrides: PYTHON, MODEL, SIZE, PATCH, BATCH,
# PROFILE (a device profile; default: the one matching GPU 0's name), TOPOLOGY (links of multi-GPU plans in step 5;
# default nvlink_8).
set -uo pipefail

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR/runs"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.." || exit 1  # the repository root, for `pip install -e .`
: >"$OUT_DIR/steps.log"
PYTHON="${PYTHON:-python3}"
BUDGET_SECONDS=450  # 7.5 min: a step that could end later is skipped, so the whole check stays under 8
TOTAL=0
OK=0

section() { printf '\n===== %s =====\n' "$*"; }

# tally RC [ACCEPTED...]: count one step, ok when RC is 0 or one of ACCEPTED.
tally() {
  local rc=$1 code
  shift
  TOTAL=$((TOTAL + 1))
  for code in 0 "$@"; do
    if ((rc == code)); then OK=$((OK + 1)); return 0; fi
  done
  echo "step failed (exit $rc)"
}

# run_step SECONDS STDOUT CMD...: CMD under timeout; its stderr (and its stdout when STDOUT is -) is appended to
# steps.log and its last lines shown. A step that could end past the budget is skipped.
run_step() {
  local limit=$1 stdout=$2 rc
  shift 2
  if ((SECONDS + limit > BUDGET_SECONDS)); then
    echo "skipped, it could pass the ${BUDGET_SECONDS} s budget: $*" | tee -a "$OUT_DIR/steps.log"
    return 124
  fi
  echo "\$ $*" | tee -a "$OUT_DIR/steps.log"
  local step_output="$OUT_DIR/runs/step_output.txt"
  if [[ $stdout == - ]]; then
    timeout --kill-after=10 "$limit" "$@" >"$step_output" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@" >"$stdout" 2>"$step_output"
  fi
  rc=$?
  cat "$step_output" >>"$OUT_DIR/steps.log"
  tail -n 3 "$step_output"
  rm -f "$step_output"
  echo "(exit $rc; ${SECONDS} s since the start)"
  return $rc
}

HSLITE=("$PYTHON" -m hslite.cli)  # the hslite of $PYTHON, whatever `hslite` is first on PATH

if ((DRY_RUN)); then
  ACCELERATOR=cpu
  MODEL="${MODEL:-cnn1d}" SIZE="${SIZE:-small}" PATCH="${PATCH:-1}" BATCH="${BATCH:-32}"
  TRAIN_BATCHES=16 PREFLIGHT_LIMIT=60 FIT_LIMIT=45 FRESH=false
else
  ACCELERATOR=gpu
  MODEL="${MODEL:-channel_vit}" SIZE="${SIZE:-large}" PATCH="${PATCH:-9}" BATCH="${BATCH:-128}"
  TRAIN_BATCHES=40 PREFLIGHT_LIMIT=150 FIT_LIMIT=75 FRESH=true
fi

section "1. environment ($([[ $DRY_RUN == 1 ]] && echo 'dry run on CPU' || echo GPU))"
if ! "$PYTHON" -c "import hslite" 2>/dev/null; then
  echo "hslite does not import: pip install -e ."
  "$PYTHON" -m pip install -q -e . || { echo "pip install -e . failed"; exit 1; }
fi
"$PYTHON" - <<'EOF' | tee "$OUT_DIR/environment.txt"
import os, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{len(os.sched_getaffinity(0))} CPU cores")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB")
EOF
if ((DRY_RUN)); then
  DEVICES_ALL=2
else
  DEVICES_ALL=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
  if ((DEVICES_ALL < 1)); then
    echo "no CUDA device visible: run with --dry-run on a CPU box"
    exit 1
  fi
fi

COMMON=(recipe=quickstart "parallel.accelerator=$ACCELERATOR" "model.name=$MODEL" "model.size=$SIZE"
  "data.patch_size=$PATCH" "data.batch_size=$BATCH")

section "2. pre-flight: probe + links for $DEVICES_ALL × $ACCELERATOR ($MODEL-$SIZE, patch $PATCH, batch $BATCH)"
run_step "$PREFLIGHT_LIMIT" "$OUT_DIR/preflight.json" "${HSLITE[@]}" preflight "${COMMON[@]}" "parallel.devices=$DEVICES_ALL" \
  "preflight.fresh=$FRESH" --json
rc=$?
tally $rc 3  # 3 is NO-GO: a verdict, not a failure
if ((rc == 0 || rc == 3)); then
  "$PYTHON" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
report = json.loads(Path(sys.argv[1], "preflight.json").read_text())
pred = report["requested_prediction"]
print(f"{'GO' if report['go'] else 'NO-GO'} {report['requested']}: predicted step {pred['step_seconds']:.4g} s "
      f"(compute {pred['compute_seconds']:.4g}, exposed comm {pred['comm_seconds']:.4g}), E = {report['efficiency']:.2f}")
print("best passing:", report["best_passing"])
EOF
fi

section "3. short fits: predicted vs measured step time"
FIT_COMMON=("${COMMON[@]}" "train.max_epochs=1" "train.limit_train_batches=$TRAIN_BATCHES" "train.limit_val_batches=2"
  "train.limit_test_batches=2" "data.train_fraction=0.8" "data.val_fraction=0.1" "train.progress=false"
  "output.save_map=false" "output.save_checkpoint=false" "preflight.enforce=false")
if ((DRY_RUN)); then
  COMBOS=("1 32-true 1" "$DEVICES_ALL 32-true 1" "1 bf16-mixed 1" "1 32-true 4")
else
  COMBOS=()
  for devices in $(printf '%s\n' 1 "$DEVICES_ALL" | sort -un); do
    for precision in 32-true bf16-mixed; do
      for accumulate in 1 4; do COMBOS+=("$devices $precision $accumulate"); done
    done
  done
fi
for combo in "${COMBOS[@]}"; do
  read -r devices precision accumulate <<<"$combo"
  tag="d${devices}_${precision}_acc${accumulate}"
  run_step "$FIT_LIMIT" - "${HSLITE[@]}" fit "${FIT_COMMON[@]}" "parallel.devices=$devices" \
    "parallel.precision=$precision" "parallel.accumulate=$accumulate" "output.root=$OUT_DIR/runs/$tag"
  tally $?
done

section "4. summary: predicted vs measured"
"$PYTHON" - "$OUT_DIR" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, statistics, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1], "runs").glob("*/*/*/preflight.json")):
    report = json.loads(path.read_text())
    plan, measured = report["requested_plan"], report["measured"]
    if measured is None:  # the plan changed mid-run (a compression guard relaxed it): no like-for-like pair
        continue
    rows.append((report["requested"], measured["predicted_step_seconds"], measured["step_seconds"],
                 measured["relative_error"], report["efficiency"], report["go"],
                 measured["samples_per_second"] / plan["devices"]))
if not rows:
    sys.exit("no run finished: see steps.log")
best_single = max(r[6] for r in rows if r[0].startswith("1×"))
width = max(len(r[0]) for r in rows)
print(f"{'plan':<{width}}  {'pred s':>9}  {'meas s':>9}  {'rel err':>8}  {'pred E':>6}  {'meas E':>6}  verdict")
for name, pred, meas, err, eff, go, ecd in rows:
    print(f"{name:<{width}}  {pred:>9.4g}  {meas:>9.4g}  {err:>+8.0%}  {eff:>6.2f}  {ecd / best_single:>6.2f}  "
          f"{'GO' if go else 'NO-GO'}")
print("meas E: measured samples/s per device ÷ the best single-device run's")
print(f"median relative error: {statistics.median(abs(r[3]) for r in rows):.0%} over {len(rows)} runs")
EOF
tally "${PIPESTATUS[0]}"

if ((DRY_RUN)); then
  PROFILE="${PROFILE:-h100_sxm}"
else
  PROFILE="${PROFILE:-$("$PYTHON" -c "import torch; from hslite.preflight.device_profile import device_for_gpu
print(device_for_gpu(torch.cuda.get_device_name(0)) or '')")}"
fi
TOPOLOGY="${TOPOLOGY:-nvlink_8}"
section "5. device profile ${PROFILE:-?}: the same plans priced from its datasheet (roofline), against the fits"
if [[ -z $PROFILE ]]; then
  echo "no device profile matches this GPU: set PROFILE=NAME (hslite/preflight/devices/)"
  tally 1
else
  "$PYTHON" - "$OUT_DIR" "$PROFILE" "$TOPOLOGY" "${COMMON[@]}" <<'EOF' 2>>"$OUT_DIR/steps.log" | tee "$OUT_DIR/profile.txt"
import json, statistics, sys
from pathlib import Path
from hslite.config import load_config
from hslite.gate import check_recipe
from hslite.parallel.plan import Plan
out_dir, profile, topology, *common = sys.argv[1:]
rows = []
for path in sorted(Path(out_dir, "runs").glob("*/*/*/preflight.json")):
    report = json.loads(path.read_text())
    if report["measured"] is None:  # the plan changed mid-run: no like-for-like pair
        continue
    plan = Plan(**report["requested_plan"])
    cfg = load_config(None, [*common, *plan.overrides().split(), "parallel.accelerator=gpu",
                             f"preflight.device={profile}", f"preflight.topology={topology}"])
    verdict = check_recipe(cfg, from_profile=True)  # priced from the profile even where the GPU is here
    priced, measured = verdict.predictions[verdict.requested].step_seconds, report["measured"]["step_seconds"]
    rows.append((report["requested"], report["measured"]["predicted_step_seconds"], priced, measured,
                 (priced - measured) / measured))
if not rows:
    sys.exit("no run finished: see steps.log")
width = max(len(r[0]) for r in rows)
print(f"{'plan':<{width}}  {'probe s':>9}  {profile + ' s':>14}  {'meas s':>9}  {'profile err':>11}")
for name, probed, priced, measured, err in rows:
    print(f"{name:<{width}}  {probed:>9.4g}  {priced:>14.4g}  {measured:>9.4g}  {err:>+11.0%}")
print(f"probe s: the measured probe's prediction; {profile} s: the profile's roofline (e and launch cost: "
      f"hslite/preflight/device_profile.py), links of multi-GPU plans from the topology {topology}")
print(f"median profile error: {statistics.median(abs(r[4]) for r in rows):.0%} over {len(rows)} runs")
EOF
  tally "${PIPESTATUS[0]}"
fi

echo
echo "gpu_check: $OK/$TOTAL steps ok in ${SECONDS} s; outputs in $OUT_DIR"
((OK == TOTAL))
