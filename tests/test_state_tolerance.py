"""The GPU state comparison (exactness.within): per state, within atol of its largest magnitude."""

import numpy as np

from ortspec.speculative.exactness import RowState, within


def test_rounding_of_a_normalised_head_passes_a_wrong_slot_fails():
    rng = np.random.default_rng(0)
    plain = rng.normal(size=(2, 64, 16)).astype(np.float32)  # [kvh, hd, slots]: one row's key cache
    plain[0, 3, 5] = 0.3  # an element near 0 of a head with values up to ~4
    rounded = plain.copy()
    rounded[0, 3, 5] += 1.4e-5  # measured on the H200 at batch 16: over 1e-5 * (1 + 0.3), under 1e-5 * (1 + 4)
    assert not np.allclose(rounded, plain, rtol=1e-5, atol=1e-5)  # the per-element rule rejected it
    assert within(rounded, plain, 1e-5)
    wrong_slot = plain.copy()
    wrong_slot[..., 7] = plain[..., 6]  # a commit one slot off
    assert not within(wrong_slot, plain, 1e-5)


def test_differences_names_the_state_over_the_bound():
    state = {"key.3": np.ones((2, 4, 8), np.float32)}
    mine = RowState(5, [1, 2], {"key.3": state["key.3"] + 1e-3}, {})
    theirs = RowState(5, [1, 2], state, {})
    assert mine.differences(theirs, atol=1e-5, head=False) == ["target state key.3 (max abs diff 1.00e-03)"]
    assert mine.differences(theirs, atol=1e-2, head=False) == []
