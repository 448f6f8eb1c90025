"""Errors a user can act on. The CLI prints their message (no traceback) and exits non-zero."""


class VismmoeError(Exception):
    """Base class: the message names the problem and what to do about it."""


class RuleError(VismmoeError):
    """A rule file or an override is wrong (the message names the file and rule index)."""


class LoadError(VismmoeError):
    """A model directory, config or checkpoint cannot be used."""


class InputError(VismmoeError):
    """A user input (image, prompt file, flag value) cannot be used."""


class PeerLostError(VismmoeError):
    """A rank of the expert-parallel group stopped answering; the others stop instead of hanging.

    The group is unusable afterwards and cannot be destroyed cleanly (gloo's teardown may abort the
    process), so whoever catches this should report it and leave with os._exit."""


class FollowerDone(Exception):
    """A follower rank's work ended (rank 0 said STOP): the command returns without doing its own."""
