"""The one way an entry point reports bad input: harness.errors.exit_on_config_error."""

from __future__ import annotations

import pytest

from harness.errors import BAD_CONFIG_EXIT, ConfigError, Unsupported, exit_on_config_error


@exit_on_config_error
def entry_point(raised: BaseException | None = None, *, answer: int = 0) -> int:
    """An entry point that raises what it is given, else returns its answer."""
    if raised is not None:
        raise raised
    return answer


def test_a_config_error_is_one_line_on_stderr_and_exit_status_2(capsys):
    with pytest.raises(SystemExit) as stopped:
        entry_point(ConfigError("batch_size: must be positive, got 0"))
    assert stopped.value.code == BAD_CONFIG_EXIT == 2
    captured = capsys.readouterr()
    assert captured.err == "kvbench: bad config: batch_size: must be positive, got 0\n" and captured.out == ""


@pytest.mark.parametrize("raised", [ValueError("not a config error"), RuntimeError("boom"), KeyboardInterrupt()])
def test_any_other_exception_propagates_as_it_is(raised, capsys):
    with pytest.raises(type(raised)) as caught:
        entry_point(raised)
    assert caught.value is raised
    assert capsys.readouterr().err == ""


def test_an_entry_point_that_succeeds_returns_its_value_and_keeps_its_name():
    assert entry_point(answer=7) == 7
    assert entry_point.__name__ == "entry_point" and "raises what it is given" in entry_point.__doc__


def test_an_unsupported_combination_reaching_the_entry_point_is_the_same_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        entry_point(Unsupported("per-sequence lengths: MLA's latent cache is read by the batch-wide paths only"))
    assert stopped.value.code == BAD_CONFIG_EXIT
    assert capsys.readouterr().err == (
        "kvbench: unsupported: per-sequence lengths: MLA's latent cache is read by the batch-wide paths only\n"
    )


def test_outside_a_hydra_job_a_rejection_removes_nothing(tmp_path, capsys):
    (tmp_path / ".hydra").mkdir()
    with pytest.raises(SystemExit):
        entry_point(ConfigError("batch_size: must be positive, got 0"))
    assert (tmp_path / ".hydra").is_dir()
