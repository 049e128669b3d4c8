"""Membership discovery: where a store learns the members of its cluster, and a watcher that follows them.

``members`` defines a member and the source interface; ``sources`` the sources (``--peers``,
``--peers-file``, ``--discovery dns://``, members fed through Python); ``watcher`` polls one source and
keeps the last good membership. Plain Python: no gRPC, no torch.
"""

from memstore.membership.members import DiscoverySource, Member, Members, validate_member
from memstore.membership.sources import DnsDiscovery, FedMembers, PeersFile, StaticPeers
from memstore.membership.watcher import DiscoveryStatus, Watcher

__all__ = [
    "DiscoverySource",
    "DiscoveryStatus",
    "DnsDiscovery",
    "FedMembers",
    "Member",
    "Members",
    "PeersFile",
    "StaticPeers",
    "Watcher",
    "validate_member",
]
