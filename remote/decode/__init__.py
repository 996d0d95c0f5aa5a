"""Decoding with a drafter: the offline walk over a reference completion (``offline``) and online
speculative decoding against the target (``online``)."""
