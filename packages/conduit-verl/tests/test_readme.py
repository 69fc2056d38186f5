"""The package README shows the exact main_ppo command the end-to-end test runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_first_line_says_what_to_install() -> None:
    first = README.read_text().splitlines()[0]
    assert first.startswith("`pip install conduit-verl`"), first


def test_readme_main_ppo_command_is_the_tested_one() -> None:
    from conduit_verl.cpu.config import main_ppo_overrides

    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    cpu = next(b for b in blocks if "python -m conduit_verl.tiny" in b)
    cmd = cpu.split("python -m conduit_verl.tiny /tmp/conduit-tiny\n", 1)[1]
    args = shlex.split(cmd.replace("\\\n", " "))
    start = args.index("verl.trainer.main_ppo") + 1
    assert args[start:] == main_ppo_overrides("/tmp/conduit-tiny", steps=2)


def test_readme_names_the_reference_models_cpu_overrides() -> None:
    from conduit_verl.cpu.config import reference_overrides

    limits = README.read_text().split("## Limits", 1)[1]
    for override in reference_overrides():
        assert f"`{override}`" in limits or f"`'{override}'`" in limits, override
