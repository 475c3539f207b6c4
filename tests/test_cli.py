"""The ``roundalign`` CLI: ``main(argv)`` in-process, and the installed console script once in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roundalign import Profile, get_profile, list_profiles
from roundalign.cli import COMMANDS, main
from roundalign.errors import ExitStatus, MissingDependency, MissingFile, UnsupportedModel, UserError
from roundalign.rl.loop import TrainingDiverged


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_profiles_table_lists_every_profile_and_vllm_formulas(capsys):
    status, out, _ = run(capsys, "profiles")
    assert status == 0
    for name in list_profiles():
        assert name in out
    for formula in get_profile("vllm").describe().values():
        for line in formula.split("; "):  # the table puts "a; b" formulas on two lines
            assert line in out, line
    assert "r(x*nu(x)*w)" in out
    assert "r(x1*c16-x2*s16)" in out
    assert "r(silu(g)*u)" in out


def test_profiles_sources_adds_the_source_column(capsys):
    _, without, _ = run(capsys, "profiles")
    status, with_sources, _ = run(capsys, "profiles", "--sources")
    assert status == 0
    assert "source" not in without.split("\n")[2]  # the header row
    assert "s4.1-4.4" in with_sources and "s4.1-4.4" not in without  # vllm's fact-sheet sections


def test_profile_detail_shows_rules_formulas_engines_and_source(capsys):
    vllm = get_profile("vllm")
    status, out, _ = run(capsys, "profiles", "vllm")
    assert status == 0
    for region, formula in vllm.describe().items():
        assert region in out
        assert str(getattr(vllm, region)) in out
        assert formula.split("; ")[0] in out
    assert "Inductor" in out  # from engines
    assert "engine-rounding.md" in out  # from source


def test_json_round_trips_to_the_builtin_profiles(capsys):
    status, out, _ = run(capsys, "profiles", "--json")
    assert status == 0
    data = json.loads(out)
    assert [d["name"] for d in data] == list_profiles()
    for d in data:
        loaded = Profile.from_dict(d)
        assert loaded == get_profile(d["name"])
        assert loaded.source == get_profile(d["name"]).source  # source is compare=False; check it anyway


@pytest.mark.parametrize("name", ["vllm", "sglang"])  # sglang's rope is the head-dim-dependent kind
def test_json_for_one_profile_is_loadable(capsys, tmp_path, name):
    status, out, _ = run(capsys, "profiles", name, "--json")
    assert status == 0
    path = tmp_path / f"{name}.json"
    path.write_text(out)
    assert Profile.load(path) == get_profile(name)


def test_unknown_profile_exits_2_and_lists_the_profiles(capsys):
    status, out, err = run(capsys, "profiles", "no-such-engine")
    assert status == 2
    assert out == ""
    assert "no-such-engine" in err
    for name in list_profiles():
        assert name in err


def test_missing_rich_says_how_to_install_it(capsys, monkeypatch):
    for mod in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    status, out, err = run(capsys, "profiles")
    assert status == ExitStatus.MISSING_DEPENDENCY == 6
    assert "pip install -e '.[cli]'" in err and "pip install rich" in err
    # --json needs no rich.
    status, out, _ = run(capsys, "profiles", "--json")
    assert status == 0 and json.loads(out)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["profiles", "--no-such-flag"])
    assert e.value.code == 2


def test_subcommands_are_registered():
    assert "profiles" in COMMANDS
    assert all(c.help for c in COMMANDS.values())


def test_console_script_runs_in_a_subprocess():
    # The installed entry point if it sits next to this interpreter (a venv), else the module.
    script = Path(sys.executable).with_name("roundalign")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "roundalign.cli"]
    env = {**os.environ, "COLUMNS": "80"}  # piped output still gets the wide table
    done = subprocess.run([*cmd, "profiles"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "r(x*nu(x)*w)" in done.stdout
    for name in list_profiles():
        assert name in done.stdout
    bad = subprocess.run([*cmd, "profiles", "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2
    assert "vllm-eager-legacy" in bad.stderr


@pytest.mark.parametrize(
    "error, status",
    [
        (UserError("--top-p must be in (0, 1]"), ExitStatus.USAGE),
        (MissingFile("results file 'x.pt' does not exist"), ExitStatus.USAGE),
        (UnsupportedModel("model_type 'gpt2' is not supported"), ExitStatus.USAGE),
        (MissingDependency("rich", "cli", "the tables"), ExitStatus.MISSING_DEPENDENCY),
        (TrainingDiverged("step 3: the loss is nan"), ExitStatus.DIVERGED),
    ],
)
def test_each_error_class_has_its_exit_status_and_one_line(capsys, monkeypatch, error, status):
    import roundalign.profiles.cli as profiles_cli

    def fail(config):
        raise error

    monkeypatch.setattr(profiles_cli, "run", fail)
    got, out, err = run(capsys, "profiles")
    assert got == status
    assert err == f"roundalign: error: {error}\n"  # one line, no traceback


def test_an_error_that_is_not_the_users_is_a_bug_with_its_traceback(monkeypatch):
    """Bad input is a UserError (exit 2, one line). A ValueError from inside roundalign is a bug: it propagates, so
    Python prints its traceback and exits 1, instead of passing for bad input."""
    import roundalign.profiles.cli as profiles_cli

    def fail(config):
        raise ValueError("an internal check failed")

    monkeypatch.setattr(profiles_cli, "run", fail)
    with pytest.raises(ValueError, match="an internal check failed"):
        main(["profiles"])


def test_the_exit_status_table_is_the_readme_one():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for status in ExitStatus:
        assert f"| {status.value} |" in readme, status


def test_import_and_help_load_neither_torch_nor_transformers():
    """``import roundalign``, ``roundalign --help`` and ``roundalign profiles`` start at once: none of them imports
    torch or transformers."""
    code = (
        "import sys, contextlib, io\n"
        "import roundalign\n"
        "from roundalign.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    main(['profiles'])\n"
        "    main(['profiles', 'vllm', '--json'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "none"


def test_lazy_attributes_are_the_real_objects():
    import roundalign
    import roundalign.patch
    import roundalign.profiles

    assert roundalign.apply is roundalign.patch.apply
    assert roundalign.get_profile is roundalign.profiles.get_profile
    assert roundalign.ops.rms_norm is not None  # a subpackage, imported on first use
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        roundalign.nope  # noqa: B018


def test_piped_output_takes_columns_when_set_and_a_wide_default_otherwise(monkeypatch):
    from roundalign.console import PIPED_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console().width == PIPED_WIDTH  # pytest's captured stdout is not a terminal
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100


@pytest.mark.parametrize("width", [80, 120, 200])
def test_profiles_overview_fits_any_width_and_cuts_no_formula(width):
    """Below the width the side-by-side table needs, one table per profile: every line fits and every formula line
    is printed whole."""
    import io

    from rich.console import Console

    from roundalign.profiles.cli import overview

    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    for renderable in overview([get_profile(n) for n in list_profiles()], False, console):
        console.print(renderable)
    text = console.file.getvalue()
    assert all(len(line) <= width for line in text.splitlines())
    assert "…" not in text
    for name in list_profiles():
        assert name in text
        for formula in get_profile(name).describe().values():
            for line in formula.split("; "):
                assert line in text, (name, line)


@pytest.mark.parametrize("width", [80, 120, 200])
@pytest.mark.parametrize("name", ["vllm", "sglang"])  # sglang's RoPE rule is the longest
def test_profile_detail_fits_any_width_and_cuts_nothing(name, width):
    import io

    from rich.console import Console

    from roundalign.profiles.cli import detail

    console = Console(width=width, file=io.StringIO(), force_terminal=False)
    for renderable in detail(get_profile(name), console):
        console.print(renderable)
    text = console.file.getvalue()
    assert all(len(line) <= width for line in text.splitlines()) and "…" not in text
    profile = get_profile(name)
    for region, formula in profile.describe().items():
        assert region in text
        for line in formula.split("; "):
            assert line in text, line
    assert str(profile.rules()[0]) in text
