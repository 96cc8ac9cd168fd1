"""Print pip constraints that pin each of hslite's dependencies (and the test extra's) at the floor pyproject declares.

    python .ci/floors.py > floors.txt && pip install -c floors.txt -e ".[test]"
"""

import re
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    floor = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9][0-9A-Za-z.]*)", requirement.replace(" ", ""))
    if floor is None:
        raise SystemExit(f"{requirement!r} has no plain `>=` floor to pin")
    print(f"{floor[1]}=={floor[2]}")
