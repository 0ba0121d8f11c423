"""tests/greedy.py, the rule the strategy tests compare greedy tokens by: equal up to a near-tie of the reference."""

from __future__ import annotations

import pytest
import torch

from tests.greedy import assert_no_near_tie, assert_same_greedy_tokens

TOL = 1e-5


def reference(margin_at_step_1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, 3, 4] whose greedy choice is token 0 at every step, leading token 1 by margin_at_step_1 at step 1
    (by 1.0 elsewhere), and those choices [1, 3]."""
    logits = torch.zeros(1, 3, 4)
    logits[0, :, 0] = 1.0
    logits[0, 1, 1] = 1.0 - margin_at_step_1
    return logits.argmax(dim=-1), logits


def test_a_sequence_may_leave_the_reference_at_a_near_tie_and_go_its_own_way():
    expected, logits = reference(margin_at_step_1=1e-6)
    assert_same_greedy_tokens(torch.tensor([[0, 1, 3]]), expected, logits, tol=TOL)  # the runner-up, then anything


def test_a_sequence_that_leaves_the_reference_at_a_clear_margin_fails():
    expected, logits = reference(margin_at_step_1=1e-6)
    with pytest.raises(AssertionError, match=r"leaves the reference at step 2, where its top-1 margin is 1\.00e\+00"):
        assert_same_greedy_tokens(torch.tensor([[0, 0, 3]]), expected, logits, tol=TOL)
    expected, logits = reference(margin_at_step_1=1e-3)
    with pytest.raises(AssertionError, match=r"at step 1, where its top-1 margin is 1\.00e-03"):
        assert_same_greedy_tokens(torch.tensor([[0, 1, 0]]), expected, logits, tol=TOL)


def test_logits_that_did_not_choose_the_reference_tokens_are_refused():
    expected, logits = reference(margin_at_step_1=1.0)
    with pytest.raises(AssertionError, match="not the ones that chose"):
        assert_same_greedy_tokens(expected, expected.roll(1, dims=1) + 1, logits, tol=TOL)


def test_digests_are_owed_only_without_a_near_tie():
    assert_no_near_tie(reference(margin_at_step_1=1e-3)[1], tol=TOL)
    with pytest.raises(AssertionError, match=r"near-tie \(top-1 margin 1\.01e-06 <= 1e-05\)"):
        assert_no_near_tie(reference(margin_at_step_1=1e-6)[1], tol=TOL)
