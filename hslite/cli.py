"""hslite command line.

    hslite fit                                   # the embedded quickstart recipe: synthetic scene, CPU, ~1 minute
    hslite fit recipe=salinas_a_1gpu data.root=../shared/data train.max_epochs=30
    hslite preflight recipe=quickstart_cpu4      # exit 0 GO, 3 NO-GO, 4 undecided here, 2 usage error
    hslite fit recipe=quickstart_cpu2 parallel.plan=auto   # train the fastest plan the pre-flight finds here
    hslite compare recipes=compare_cpu_*         # predictions side by side; measure=true steps=30 runs each too
    hslite recipes                               # list recipes
    hslite models                                # list models
    hslite data list | info SCENE|PATH | fetch SCENE [data.root=DIR]
    hslite topology measure --devices 4 --output box.yaml   # this box's links, for preflight.topology=box.yaml
    hslite fit data.scene=cube.hdr data.labels=gt.tif   # your own cube and label raster
    hslite predict run=runs/quickstart/STAMP [cube=PATH] [probabilities=true]   # map a cube with a finished run

Overrides are `section.key=value` (see `hslite recipes --keys`); precedence: command line > recipe > defaults.
Heavy libraries (torch, Lightning) are imported only by the command that needs them, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from hslite.errors import HSLiteError
from hslite.process.allocator import keep_freed_memory

EXIT_USAGE = 2


def _cmd_fit(args: argparse.Namespace) -> int:
    from hslite.api import fit  # torch + Lightning load only once the config is known to be valid

    fit(None, args.overrides)
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from hslite.run.predict import parse_options, predict  # imports torch: only for this command

    result = predict(parse_options(args.overrides))
    print(f"hslite predict: wrote {result.out_dir} (georeference: {result.georeference})")
    return 0


def _cmd_preflight(args: argparse.Namespace) -> int:
    import json

    from hslite.api import preflight

    verdict = preflight(None, args.overrides)
    from hslite.preflight_check.decide.report import print_verdict

    if args.json:
        print(json.dumps(verdict.to_dict(), indent=2, default=str))
    else:
        print_verdict(verdict)
    return verdict.exit_code


def _cmd_compare(args: argparse.Namespace) -> int:
    from hslite.comparison.measure import run_compare  # torch and Lightning only once every config is valid
    from hslite.comparison.report import print_compare
    from hslite.comparison.rows import parse_options

    options = parse_options(args.overrides)
    rows, folder = run_compare(options, progress=lambda line: print(line, file=sys.stderr))
    print_compare(rows, options, folder, as_json=args.json)
    return 1 if any(row.failure for row in rows) else 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from hslite.recipe.config import list_recipes
    from hslite.recipe.schema import described_keys

    if args.keys:
        for key, default, why in described_keys():
            print(f"{key}={'null' if default is None else default}" + (f"  # {why}" if why else ""))
        return 0
    recipes = list_recipes()
    width = max(map(len, recipes))
    for name, description in recipes.items():
        print(f"{name:<{width}}  {description}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from hslite.models import describe_models, plugin_errors

    for name, description in describe_models().items():
        print(f"{name:<15} {description}")
    errors = plugin_errors()
    for sentence in errors:
        print(f"hslite: error: {sentence}", file=sys.stderr)
    return 1 if errors else 0


def _cmd_data(args: argparse.Namespace) -> int:
    from hslite.datasets.scenes import registry as scenes
    from hslite.recipe.config import parse_overrides

    if args.scene and "=" in args.scene:  # argparse took an override for the scene
        args.overrides, args.scene = [args.scene, *args.overrides], None
    if args.action == "list" and args.scene:
        raise HSLiteError(
            f"`hslite data list` takes no scene, got {args.scene!r}; use `hslite data info {args.scene}`."
        )
    options = dict(parse_overrides(args.overrides))
    unknown = set(options) - {"data.root"}
    if unknown:
        raise HSLiteError(f"`hslite data` takes only data.root=DIR, got {', '.join(sorted(unknown))}.")
    root = options.get("data.root")
    if args.action == "list":
        for name in scenes.list_scenes():
            spec = scenes.get_scene_spec(name)
            rows, cols, bands = spec.shape
            where = "download" if spec.cube_file.url else ("generated" if spec.cube_file.name == "" else "local files")
            print(f"{name:<24} {rows}×{cols}×{bands:<4} {len(spec.class_names):>2} classes  {where:<11} {spec.title}")
        return 0
    if not args.scene:
        raise HSLiteError(f"`hslite data {args.action}` needs a scene name; see `hslite data list`.")
    from hslite.datasets.scenes.own_scene import describe_file, is_scene_path

    if args.action == "info" and is_scene_path(args.scene):
        print("\n".join(describe_file(args.scene)))
        return 0
    spec = scenes.get_scene_spec(args.scene)
    if args.action == "info":
        folder = scenes.default_data_root() if root is None else root
        rows, cols, bands = spec.shape
        print(f"{spec.name}: {spec.title} ({spec.sensor}), {rows}×{cols} pixels, {bands} bands")
        print(spec.description)
        for f in (spec.cube_file, spec.gt_file):
            source = f.url or "local only"
            print(f"  {f.name}: {source} sha256={f.sha256 or 'unknown'} -> {folder}/{spec.name}/{f.name}")
        print("  classes: " + ", ".join(f"{i + 1} {c}" for i, c in enumerate(spec.class_names)))
        return 0
    scene = scenes.load_scene(args.scene, root=root, download=True)
    print(f"{args.scene}: ready, cube {scene.cube.shape}, {scene.num_classes} classes")
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from hslite.parallel.box import resolve_accelerator
    from hslite.preflight_check.hardware.topology import load_topology
    from hslite.preflight_check.hardware.topology_file import measure_topology, write_topology

    accelerator = resolve_accelerator(args.accelerator)
    path = write_topology(measure_topology(args.devices, accelerator, fresh=args.fresh), args.output)
    topology = load_topology(str(path))
    print(f"{path}: {topology.gpus_per_node} {accelerator} ranks, {topology.intra_gbps:.3g} GB/s busbw, "
          f"{topology.intra_latency_us:.3g} µs per ring step; price with preflight.topology={path}")  # fmt: skip
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hslite",
        description="Hyperspectral training on one box; a pre-flight check refuses multi-GPU plans that do not pay.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    add("fit", _cmd_fit, "train, test and report one recipe").add_argument(
        "overrides", nargs="*", metavar="key=value", help="recipe=NAME and section.key=value overrides"
    )
    p = add("preflight", _cmd_preflight, "GO (exit 0) / NO-GO (exit 3): does this multi-device plan pay?")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe=NAME and section.key=value overrides")
    p.add_argument("--json", action="store_true", help="print the full report as JSON instead of a table")
    p = add("compare", _cmd_compare, "several recipes side by side: predicted and (measure=true) measured")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="recipes=A,B,... and/or rows=FILE.yaml [measure=true steps=N auto=R reference=false] k=v",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    p = add("predict", _cmd_predict, "map a cube with a finished run: prediction.tif, map.png, probabilities")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run=RUN_DIR, cube=PATH, output=DIR, ...")
    p = add("recipes", _cmd_recipes, "list the shipped recipes")
    p.add_argument("--keys", action="store_true", help="every key a recipe or override may set, its default and why")
    add("models", _cmd_models, "list the registered models")
    p = add("data", _cmd_data, "list, describe or fetch scenes")
    p.add_argument("action", choices=("list", "info", "fetch"))
    p.add_argument("scene", nargs="?", help="scene name (info, fetch), or the path of a cube or label file (info)")
    p.add_argument("overrides", nargs="*", metavar="data.root=DIR")
    p = add("topology", _cmd_topology, "measure this box's links and write a topology profile (preflight.topology=)")
    p.add_argument("action", choices=("measure",))
    p.add_argument("--devices", type=int, required=True, help="ranks of the measured all-reduce (2 or more)")
    p.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "gpu"), help="gloo processes or GPUs")
    p.add_argument("--output", required=True, help="the .yaml file to write (never overwritten)")
    p.add_argument("--fresh", action="store_true", help="measure again instead of reading the link cache")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hslite` console script; returns the exit code."""
    parser = _parser()
    # Overrides may stand on either side of flags (`preflight recipe=R --json k=v`); argparse stops a positional
    # list at the first flag, so the key=value items after it come back as extras and join the list here.
    args, extras = parser.parse_known_args(argv)
    stray = [item for item in extras if item.startswith("-") or "=" not in item or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    keep_freed_memory()  # for every command that trains, times or predicts (hslite.process.allocator says why)
    try:
        code = args.handler(args)
    except HSLiteError as err:
        print(f"hslite: error: {err}", file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        print("hslite: interrupted", file=sys.stderr)
        code = 130
    distributed = sys.modules.get("torch.distributed")  # not imported: no process group, and no torch import here
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        from hslite.parallel.spawned_rank import end_finished_rank

        end_finished_rank(code)  # a rank torchrun or srun started: its group's threads must not outlive the interpreter
    return code


if __name__ == "__main__":
    sys.exit(main())
