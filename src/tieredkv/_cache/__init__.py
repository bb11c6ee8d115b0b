"""The parts of :class:`tieredkv.TieredKVCache`, one concern each (private).

- :mod:`.state`: sessions, their locks, the counters, and publishing to the channel;
- :mod:`.atomic`: running a move to completion whatever cancels its caller;
- :mod:`.placement`: reserving room, promoting, demoting, evicting, and forgetting copies;
- :mod:`.writethrough`: background copies to the next tier (inclusive mode);
- :mod:`.recovery`: rebuilding the index from what persistent tiers kept;
- :mod:`.gather`: segments to tensors and back.
"""
