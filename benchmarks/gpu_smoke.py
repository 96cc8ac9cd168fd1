"""hslite's smoke on a GPU box: every path that runs differently on CUDA, one PASS / FAIL / SKIP line per check.

Here, once, with the package registry at hand (the box is offline):

    python benchmarks/gpu_smoke.py --fetch-wheels   # what the box lacks -> benchmarks/gpu_wheels/ (git-ignored, 36 MiB)

then carry that folder with the working tree to the box (one NVIDIA GPU) and run, as one call with a 300 s timeout,

    python benchmarks/gpu_smoke.py                  # install the wheels and hslite, then the sections on cuda:0
    python benchmarks/gpu_smoke.py --dry-run        # anywhere: the same on the CPU (gloo for NCCL, tiny sizes), ~1 min

The box is lent for 15 minutes of device time in all, and each start of it costs up to 2: the whole smoke has
BUDGET_SECONDS (4.5 min), so that a second run, after a fix, still fits. Its steps run in that order, most valuable
first, each in a process of its own under its own limit; the limits add up to the budget at most (both runs print
them and refuse to start otherwise), so a step that overruns is killed at its limit and costs no other step its time:
  install  benchmarks/gpu_wheels/*.whl, then this tree (setuptools from the wheels, which compiles the C patch
           gather), with `pip install --no-index --no-deps --target` into a scratch folder put on PYTHONPATH: the
           box's own packages are left as they are. Then the box's torch and Lightning against the floors the
           installed hslite declares: older ones stop the smoke with one sentence. --dry-run checks only that the
           wheel folder, when present, holds every requirement, and uses this environment as it is.
  e        the calibration: `hslite compare` rows, each a short fit in a process of its own (the quickstart in fp32,
           HybridSN, the quickstart in bf16-mixed; fp32 alone on a dry run): the measured step against the probe's
           prediction and the device profile's roofline, and the e and launch cost that would have matched
  d        each shipped GPU recipe's batch: C, torch and GPU gathers, pageable and pinned copies, against one
           training step of its model, in samples/s
  a        hslite's fence on a group bound to cuda:0 as Lightning binds it: its own gloo group, never NCCL, where a
           plain barrier would take the bound GPU; then every collective hslite issues on CUDA tensors in that group
  b        the int8 hook's quantise and dequantise on cuda:0 against the CPU (at one rank the hook sends nothing);
           `hslite fit` in 16-mixed (the gradient scaler), deterministic twice (bitwise equal), stopped and resumed
           (bitwise the uninterrupted run); hslite's int8 DDP and FSDP2 strategies at world size 1
  c        two gloo ranks sharing cuda:0: the int8 hook and the channel-group token exchange across processes
Check lines read `PASS|FAIL|SKIP <section>.<check>: <detail>`; the run ends with `SUMMARY pass=N fail=M skip=K`, which
names the checks a one-GPU box cannot run, and exits 1 when a check failed. Outputs, in $OUT when set, else
./gpu_smoke_out: smoke.log (all each step printed), summary.txt (the check lines), results.json (checks, data-path
rates, calibration rows), confusion.png and map.png of a deterministic fp32 fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from time import perf_counter
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "gpu_wheels"
REQUIREMENTS = ROOT / "benchmarks" / "gpu_smoke_requirements.txt"
SOURCE_ONLY = ("spectral==0.25",)  # published as a source archive only: built here into a pure-Python wheel
WHEEL_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                "--platform", "manylinux_2_28_x86_64")  # the GPU box's Python and platform  # fmt: skip
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device machine carries of ignored paths
# 15 minutes of device time for two runs, each paying a start of up to 2 minutes and a few seconds of transfers:
# 2 × (120 + 270) leaves a minute for a failed start or the idle wait after a call.
BUDGET_SECONDS = 270
INSTALL_SECONDS = 40  # three offline pip installs, a C file compiled: ~20 s expected on the box's 16 cores
# Section -> (module of its checks, seconds it may take on the GPU box, what it checks), in the order they run: the
# calibration first, then what a GPU changes, then what one GPU can only approximate. The limits are estimates of a
# box that has not run it yet, with half again for margin; smoke.log keeps each section's time for the next sizing.
SECTIONS = {
    "e": ("_gpu_smoke_fits", 90, "calibration: 3 compare rows, the probe's step against the measured one"),
    "d": ("_gpu_smoke_sections", 45, "data path: gathers and copies of each GPU recipe against its step"),
    "a": ("_gpu_smoke_sections", 20, "fences over gloo on a group bound to the GPU; collectives on it"),
    "b": ("_gpu_smoke_fits", 50, "int8 round trip on the GPU; fits: 16-mixed, deterministic, resume, DDP, FSDP2"),
    "c": ("_gpu_smoke_sections", 25, "two gloo ranks sharing the GPU: int8 hook, token exchange"),
}
ONE_GPU = "a one-GPU box cannot run two NCCL ranks"  # a SKIP that says this is named in the SUMMARY line
BOX_PACKAGES = ("torch", "lightning")  # the box's own; the carried wheels bring hslite's other dependencies, pinned
CHECK = re.compile(r"^(PASS|FAIL|SKIP) (\S+): (.*)$")


class Smoke:
    """One run's record: its check lines (printed and counted) and smoke.log (everything)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.log = (out / "smoke.log").open("w")
        self.checks: list[tuple[str, str, str]] = []
        self.start = perf_counter()

    def check(self, status: str, name: str, detail: str) -> None:
        """Record one check line."""
        line = f"{status} {name}: {detail}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.checks.append((status, name, detail))

    def run(self, command: list[str], limit_seconds: float, **kwargs: object) -> tuple[int | None, str]:
        """Run `command` in a session of its own; (exit code, or None when it was killed at the limit; output)."""
        self.log.write(f"\n$ {' '.join(map(str, command))}\n")
        self.log.flush()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, **kwargs)  # type: ignore[call-overload]  # fmt: skip
        try:
            output, code = proc.communicate(timeout=limit_seconds)[0], proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step and any rank it spawned
            output, code = proc.communicate()[0], None
        self.log.write(output + f"(exit {code}, {perf_counter() - self.start:.0f} s since the start)\n")
        self.log.flush()
        return code, output

    def seconds_left(self) -> float:
        """What is left of the budget."""
        return BUDGET_SECONDS - (perf_counter() - self.start)


def budget_plan() -> tuple[list[str], bool]:
    """The steps with their limits and their total against the budget, as lines; whether they fit it."""
    steps = [("install", INSTALL_SECONDS, "wheels and hslite; the box's torch and Lightning against hslite's floors")]
    steps += [(section, limit, what) for section, (_, limit, what) in SECTIONS.items()]
    total = sum(limit for _, limit, _ in steps)
    fits = total <= BUDGET_SECONDS
    lines = [f"  {name:<8}{limit:>4} s  {what}" for name, limit, what in steps]
    lines.append(f"  total {total} s of the {BUDGET_SECONDS} s budget: " + ("fits" if fits else "does NOT fit"))
    return lines, fits


def required_wheels() -> list[str]:
    """Every `name==version` the box needs a wheel of."""
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line] + list(SOURCE_ONLY)


def find_wheels() -> tuple[list[Path], list[str]]:
    """The wheel of each requirement in benchmarks/gpu_wheels/, and the requirements that have none there."""
    found, missing = [], []
    wheels = sorted(WHEELS.glob("*.whl"))
    for requirement in required_wheels():
        name, version = requirement.split("==")
        prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
        match = [wheel for wheel in wheels if wheel.name.lower().startswith(prefix)]
        if match:
            found.append(match[0])
        else:
            missing.append(requirement)
    return found, missing


def fetch_wheels() -> int:
    """Download (or build, for source-only packages) the box's wheels into benchmarks/gpu_wheels/; exit code."""
    pip = [sys.executable, "-m", "pip"]
    for command in ([*pip, "download", "--no-deps", "--only-binary=:all:", *WHEEL_TARGET, "-d", str(WHEELS), "-r",
                     str(REQUIREMENTS)], [*pip, "wheel", "--no-deps", "-w", str(WHEELS), *SOURCE_ONLY]):  # fmt: skip
        print("$", " ".join(command), flush=True)
        if subprocess.run(command, check=False).returncode:
            return 1
    found, missing = find_wheels()
    size = sum(wheel.stat().st_size for wheel in found)
    print(f"{WHEELS}: {len(found)} wheels, {size / 2**20:.1f} MiB of the {CARRY_LIMIT_BYTES // 2**20} MiB the device "
          "machine carries" + (f"; missing: {', '.join(missing)}" if missing else ""))  # fmt: skip
    return 1 if missing or size > CARRY_LIMIT_BYTES else 0


def check_wheels(smoke: Smoke, dry_run: bool) -> list[Path]:
    """The carried wheels, one per requirement; a FAIL line naming what is missing (a SKIP when a dry run has none)."""
    found, missing = find_wheels()
    if not missing:
        size = sum(wheel.stat().st_size for wheel in found) / 2**20
        smoke.check("PASS", "install.wheels", f"{len(found)} wheels for the {len(found)} requirements, {size:.1f} MiB")
    elif dry_run and not WHEELS.is_dir():
        smoke.check("SKIP", "install.wheels", f"{WHEELS.relative_to(ROOT)}/ is absent (`--fetch-wheels` fills it); "
                    "--dry-run uses this environment's packages")  # fmt: skip
    else:
        fetch = "`python benchmarks/gpu_smoke.py --fetch-wheels` where the registry is reachable"
        smoke.check("FAIL", "install.wheels", f"{WHEELS} lacks {', '.join(missing)}: run {fetch}, and carry the folder")
    return found


def install(smoke: Smoke, wheels: list[Path], work: Path) -> dict[str, str]:
    """pip-install the wheels, then hslite from this tree, into work/site; the environment that imports them."""
    site, tools = work / "site", work / "build-tools"

    def pip_into(folder: Path, *what: str | Path) -> list[str]:
        return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(folder),
                *map(str, what)]  # fmt: skip

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # setuptools goes to a folder of its own, on the path of hslite's build only (--no-build-isolation: the build
    # imports it from there): at run time it must not shadow the box's own.
    setuptools = [wheel for wheel in wheels if wheel.name.startswith("setuptools-")]
    steps = {
        "install.dependencies": [(pip_into(site, *(w for w in wheels if w not in setuptools)), env)],
        "install.hslite": [(pip_into(tools, *setuptools), env),
                           (pip_into(site, "--no-build-isolation", ROOT), dict(env, PYTHONPATH=str(tools)))],
    }  # fmt: skip
    ends = perf_counter() + INSTALL_SECONDS
    for name, commands in steps.items():
        for command, command_env in commands:
            code, output = smoke.run(command, max(1.0, ends - perf_counter()), env=command_env, cwd=ROOT)
            if code != 0:
                last = output.strip().splitlines()[-1:] or ["no output"]
                smoke.check("FAIL", name, f"pip {'timed out' if code is None else f'exited {code}'}: {last[0][:300]}")
                break
        else:
            built = any((site / "hslite" / "datasets").glob("_patchgather*.so"))
            what = (
                f"{len(wheels) - len(setuptools)} wheels"
                if name == "install.dependencies"
                else ("hslite from this tree, C patch gather " + ("built" if built else "NOT built (no C compiler?)"))
            )
            smoke.check("PASS", name, f"{what} into {site}")
    return dict(env, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def box_requirements(requires: list[str]) -> list[Any]:
    """hslite's requirements on BOX_PACKAGES, from its requirement lines (those of an extra left out), parsed."""
    from packaging.requirements import Requirement  # a dependency of Lightning's: wherever Lightning is, it is

    parsed = (Requirement(line) for line in requires)
    return [r for r in parsed if r.name in BOX_PACKAGES and (r.marker is None or r.marker.evaluate({"extra": ""}))]


def version_gap(requires: list[str], installed: dict[str, str | None]) -> str:
    """The sentence that stops the smoke where a box package is older than hslite requires; "" where none is.

    `requires`: hslite's requirement lines (its metadata's); `installed`: each of BOX_PACKAGES's version, or None.
    """
    short = [(requirement, installed.get(requirement.name)) for requirement in box_requirements(requires)]
    short = [(r, version) for r, version in short if not version or not r.specifier.contains(version, prereleases=True)]
    if not short:
        return ""
    has = " and ".join(f"{r.name} {version}" if version else f"no {r.name}" for r, version in short)
    needs = " and ".join(str(requirement) for requirement, _ in short)
    return f"this box has {has} but hslite needs {needs}: install that, then run the smoke again"


def check_versions(smoke: Smoke, env: dict[str, str]) -> bool:
    """The box's torch and Lightning against the floors of the hslite the sections import; a FAIL line if too old."""
    from importlib.metadata import distributions

    path = [*filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *sys.path]  # where the sections import from
    found = {name: next(iter(distributions(name=name, path=path)), None) for name in ("hslite", *BOX_PACKAGES)}
    if found["hslite"] is None:
        smoke.check("FAIL", "env.versions", "hslite is not installed where the sections import it from (install.*)")
        return False
    requires = found["hslite"].requires or []
    versions = {name: getattr(found[name], "version", None) for name in BOX_PACKAGES}
    if gap := version_gap(requires, versions):
        smoke.check("FAIL", "env.versions", gap)
        return False
    floors = ", ".join(map(str, box_requirements(requires)))
    has = ", ".join(f"{name} {version}" for name, version in versions.items())
    smoke.check("PASS", "env.versions", f"{has} meet the installed hslite's {floors}")
    return True


def run_section(smoke: Smoke, section: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> None:
    """Run one section in a process of its own; its check lines count, a crash or the timeout is a FAIL."""
    limit = min(SECTIONS[section][1], smoke.seconds_left())
    if limit < 20:
        smoke.check("SKIP", f"{section}.run", f"the {BUDGET_SECONDS} s budget is spent")
        return
    command = [sys.executable, str(Path(__file__).resolve()), "--section", section, "--work", str(work), "--out",
               str(args.out), *(["--dry-run"] if args.dry_run else [])]  # fmt: skip
    print(f"-- section {section} ({perf_counter() - smoke.start:.0f} s)", flush=True)
    code, output = smoke.run(command, limit, env=env, cwd=work)
    for line in output.splitlines():
        if match := CHECK.match(line):
            smoke.check(*match.groups())
    if code != 0:
        last = [line for line in output.strip().splitlines() if not CHECK.match(line)][-1:] or ["no output"]
        why = f"killed after its {limit:.0f} s" if code is None else f"exited {code}"
        smoke.check("FAIL", f"{section}.run", f"the section's process {why}; last line: {last[0][:300]}")


def summary_line(checks: list[tuple[str, str, str]]) -> str:
    """`SUMMARY pass=N fail=M skip=K`, and the checks skipped because the box has one GPU, so none reads as covered."""
    counts = {status: sum(s == status for s, _, _ in checks) for status in ("PASS", "FAIL", "SKIP")}
    summary = f"SUMMARY pass={counts['PASS']} fail={counts['FAIL']} skip={counts['SKIP']}"
    one_gpu = [name for status, name, detail in checks if status == "SKIP" and detail.startswith(ONE_GPU)]
    return summary + (f"; not checked: {', '.join(one_gpu)} ({ONE_GPU})" if one_gpu else "")


def finish(smoke: Smoke, work: Path) -> int:
    """Write summary.txt and results.json; print the summary; the exit code."""
    summary = summary_line(smoke.checks)
    lines = [f"{status} {name}: {detail}" for status, name, detail in smoke.checks]
    (smoke.out / "summary.txt").write_text("\n".join([*lines, summary]) + "\n")
    extras = {path.stem: json.loads(path.read_text()) for path in sorted((work / "results").glob("*.json"))}
    checks = [{"status": s, "check": n, "detail": d} for s, n, d in smoke.checks]
    (smoke.out / "results.json").write_text(json.dumps({"checks": checks, **extras}, indent=1))
    smoke.log.write(summary + "\n")
    smoke.log.close()
    outputs = sorted(path.name for path in smoke.out.iterdir())
    print(f"outputs in {smoke.out}: {', '.join(outputs)}; {perf_counter() - smoke.start:.0f} s")
    print(summary)
    return 1 if any(status == "FAIL" for status, _, _ in smoke.checks) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: gloo, tiny sizes; CUDA-only checks SKIP")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the box's wheels here and stop")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_smoke_out"),
                        help="output folder (default: $OUT, else ./gpu_smoke_out)")  # fmt: skip
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)  # one section, in its process
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.fetch_wheels:
        return fetch_wheels()
    if args.section:
        import importlib

        from _gpu_smoke_sections import Context, exit_skipping_finalization

        context = Context(dry_run=args.dry_run, work=args.work, out=args.out)
        for check in importlib.import_module(SECTIONS[args.section][0]).PARTS[args.section]:
            check(context)
        exit_skipping_finalization(0)  # every check line is out; torch's teardown may abort after them
    plan, fits = budget_plan()
    print(f"gpu_smoke{' --dry-run' if args.dry_run else ''}: the box's limit of each step, in the order they run:",
          *plan, sep="\n", flush=True)  # fmt: skip
    if not fits:
        print("the limits add up to more than BUDGET_SECONDS: shorten a step before running", flush=True)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    smoke = Smoke(args.out)
    print(f"outputs in {args.out}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    try:
        wheels = check_wheels(smoke, args.dry_run)
        if args.dry_run:
            smoke.check("SKIP", "install.pip", "--dry-run: hslite and its dependencies are used as installed here")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
        else:
            env = install(smoke, wheels, work)
        if check_versions(smoke, env):
            for section in SECTIONS:
                run_section(smoke, section, args, work, env)
        return finish(smoke, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
