"""What taskonce's errors say, in the words a user reads in a worker's log."""

from __future__ import annotations

import pickle

from taskonce.errors import InProgressElsewhere


def test_in_progress_elsewhere_says_when_to_deliver_again() -> None:
    error = InProgressElsewhere("payments:m-1", 12.345)
    assert str(error) == "key 'payments:m-1' is being processed elsewhere; deliver again in 12.3 s"
    assert "lease" not in str(error)  # the delay is not the lease's end
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.key, copy.retry_after, str(copy)) == (error.key, error.retry_after, str(error))
