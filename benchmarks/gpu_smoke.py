"""hslite's smoke on a GPU box: every path that runs differently on CUDA, one PASS / FAIL / SKIP line per check.

Here, once, with the package registry at hand (the box is offline):

    python benchmarks/gpu_smoke.py --fetch-wheels   # what the box lacks -> benchmarks/gpu_wheels/ (git-ignored, 36 MiB)

then carry that folder with the working tree to the box (one NVIDIA GPU; under 8 minutes) and run

    python benchmarks/gpu_smoke.py                  # install the wheels and hslite, then sections a-e on cuda:0
    python benchmarks/gpu_smoke.py --dry-run        # anywhere: the same on the CPU (gloo for NCCL, tiny sizes), 1-2 min

Steps, each in a process of its own under its own timeout, 450 s in all (a step that would end past that is skipped,
saying so; the box's limit is 8 minutes):
  install  benchmarks/gpu_wheels/*.whl, then this tree (setuptools from the wheels, which compiles the C patch
           gather), with `pip install --no-index --no-deps --target` into a scratch folder put on PYTHONPATH: the
           box's own packages are left as they are. --dry-run checks only that the wheel folder, when present, holds
           every requirement, and uses this environment as it is.
  a        versions and the GPU; every collective hslite issues (all_reduce sum/max/avg, all_gather_into_tensor,
           all_to_all_single, reduce_scatter_tensor, broadcast, all_gather_object, barrier) on CUDA tensors in one
           rank of hslite's "cpu:gloo,cuda:nccl" group, and a CPU tensor's all_reduce on it, which must go over gloo
  b        `hslite fit` on cuda:0 in 32-true, bf16-mixed and 16-mixed; deterministic twice (bitwise equal); stopped
           and resumed (bitwise the uninterrupted run); DDP, int8-compressed DDP and FSDP2 as hslite builds them, at
           world size 1 (one GPU gives one NCCL rank)
  c        two gloo ranks sharing cuda:0: the int8 hook and the channel-group token exchange across processes
  d        each shipped GPU recipe's batch: C, torch and GPU gathers, pageable and pinned copies, against one
           training step of its model, in samples/s
  e        `hslite compare` rows, each a short fit in a process of its own (the quickstart in each precision and
           HybridSN; fp32 alone on a dry run): the measured step against the probe's prediction and the device
           profile's roofline, and the e and launch cost that would have matched
Check lines read `PASS|FAIL|SKIP <section>.<check>: <detail>`; the run ends with `SUMMARY pass=N fail=M skip=K` and
exits 1 when a check failed. Outputs, in $OUT when set, else ./gpu_smoke_out: smoke.log (all each step printed),
summary.txt (the check lines), results.json (checks, data-path rates, calibration rows), confusion.png and map.png
of the fp32 fit.
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

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "gpu_wheels"
REQUIREMENTS = ROOT / "benchmarks" / "gpu_smoke_requirements.txt"
SOURCE_ONLY = ("spectral==0.25",)  # published as a source archive only: built here into a pure-Python wheel
WHEEL_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                "--platform", "manylinux_2_28_x86_64")  # the GPU box's Python and platform  # fmt: skip
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device machine carries of ignored paths
BUDGET_SECONDS = 450  # 7.5 min: the box's limit is 8
# Section -> (module of its checks, seconds it may take on the GPU box).
SECTIONS = {"a": ("_gpu_smoke_sections", 90), "b": ("_gpu_smoke_fits", 240), "c": ("_gpu_smoke_sections", 120),
            "d": ("_gpu_smoke_sections", 150), "e": ("_gpu_smoke_fits", 210)}  # fmt: skip
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
    for name, commands in steps.items():
        for command, command_env in commands:
            code, output = smoke.run(command, min(240, smoke.seconds_left()), env=command_env, cwd=ROOT)
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


def finish(smoke: Smoke, work: Path) -> int:
    """Write summary.txt and results.json; print the summary; the exit code."""
    counts = {status: sum(s == status for s, _, _ in smoke.checks) for status in ("PASS", "FAIL", "SKIP")}
    summary = f"SUMMARY pass={counts['PASS']} fail={counts['FAIL']} skip={counts['SKIP']}"
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
    return 1 if counts["FAIL"] else 0


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
    args.out.mkdir(parents=True, exist_ok=True)
    smoke = Smoke(args.out)
    print(f"gpu_smoke{' --dry-run' if args.dry_run else ''}: outputs in {args.out}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    try:
        wheels = check_wheels(smoke, args.dry_run)
        if args.dry_run:
            smoke.check("SKIP", "install.pip", "--dry-run: hslite and its dependencies are used as installed here")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
        else:
            env = install(smoke, wheels, work)
        for section in SECTIONS:
            run_section(smoke, section, args, work, env)
        return finish(smoke, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
