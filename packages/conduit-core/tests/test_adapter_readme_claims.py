"""Doc claims no other doc test checks: the adapters' READMEs name defaults, signatures and buffer
arguments that must stay what the code has (a stale README is a bug too)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _readme(package: str) -> str:
    return (ROOT / "packages" / package / "README.md").read_text()


def test_srl_readme_buffer_names_and_args_build_conduit_buffers() -> None:
    """Every ``buffer_name="conduit..."`` / ``buffer_args=dict(...)`` pair the SRL README shows builds a
    ConduitBuffer of that semantics."""
    pytest.importorskip("conduit_srl")
    from conduit_srl import ConduitBuffer, make_conduit_buffer

    pairs = re.findall(r'buffer_name="(conduit[^"]*)", buffer_args=dict\(([^)]*)\)', _readme("conduit-srl"))
    assert len(pairs) >= 2, f"the SRL README no longer shows buffer_name/buffer_args examples: {pairs}"
    for name, args_src in pairs:
        call = ast.parse(f"dict({args_src})", mode="eval").body
        assert isinstance(call, ast.Call)
        args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
        buf = make_conduit_buffer(name, args)
        try:
            assert isinstance(buf, ConduitBuffer), (name, args, type(buf))
            want = name.split(":", 1)[1] if ":" in name else "queue"
            assert buf.config.semantics == want, f"{name!r} built a {buf.config.semantics!r} buffer, not {want!r}"
        finally:
            buf.close()


def test_verl_readme_configuration_table_is_the_backend_defaults() -> None:
    """The README's ``transfer_queue.backend.Conduit.*`` table lists every key with the code's default."""
    tq_storage = pytest.importorskip("conduit_verl.tq_storage")

    section = _readme("conduit-verl").split("### Configuration", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.M))
    defaults = tq_storage.DEFAULTS
    assert set(rows) == set(defaults), f"README keys {sorted(rows)} != code keys {sorted(defaults)}"
    for key, default in defaults.items():
        shown = rows[key].strip().strip("`")
        want = "null" if default is None else str(default)
        assert shown == want, f"README says {key} defaults to {shown!r}; the code's default is {want!r}"


def test_rllib_readme_enable_signature_is_the_code_signature() -> None:
    """``enable(config, *, placement=None, scheduler=None, prefetch=True)`` as the README writes it."""
    conduit_rllib = pytest.importorskip("conduit_rllib")

    m = re.search(r"`enable\((config, \*, [^`]*)\)`", _readme("conduit-rllib"))
    assert m is not None, "the RLlib README no longer spells enable()'s signature"
    documented = [p.strip() for p in m.group(1).split(",")]
    sig = inspect.signature(conduit_rllib.enable)
    actual = []
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in actual:
            actual.append("*")
        actual.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    assert documented == actual, f"README: enable({', '.join(documented)}); code: enable({', '.join(actual)})"


def test_rllib_readme_demo_commands_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ``conduit demo ...`` lines are accepted by the demo conduit-rllib registers (parsed, not run:
    the demo takes minutes)."""
    pytest.importorskip("conduit_rllib.demo")
    import argparse

    from conduit.cli import main

    lines = [ln.split("#", 1)[0].split() for block in re.findall(r"```bash\n(.*?)```", _readme("conduit-rllib"), re.S)
             for ln in block.splitlines() if ln.startswith("conduit demo")]
    assert len(lines) >= 2 and any(len(argv) > 2 for argv in lines), lines

    class Parsed(BaseException):
        pass

    parsed_by: list[str] = []
    real = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        parsed_by.append(self.prog)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for argv in lines:
        parsed_by.clear()
        try:
            main(argv[1:])
        except Parsed:
            pass
        except SystemExit as e:
            pytest.fail(f"the RLlib README's `{' '.join(argv)}` is refused by the demo (exit {e.code})")
        assert parsed_by == ["conduit demo"], f"`{' '.join(argv)}` was not parsed by the RLlib demo: {parsed_by}"
