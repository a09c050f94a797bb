"""A manager's local tier: when and what it saves to a host's own folder (`tiered.py`), that folder
with its retention and bounds (`local_tier.py`), parts sent to ranks of other hosts (`peer_copy.py`),
and the restore that agrees on a step and reads each part from its fastest source (`tier_restore.py`).
"""
