"""Collective safety: bounded waits, and one rank's failure raised on every rank.

Every megastart collective runs inside :func:`all_or_none`: the block runs on
every rank, then the ranks agree (over their control plane, :class:`Control`: a tree of
small gloo groups, each node's ranks and then at most :data:`FANOUT` node leaders at a
time, made from the store and kept for the process; bounded by ``timeout_s``) on whether
any of them failed. If one did, every rank
raises the same :class:`CollectiveError`, naming the rank and its error. A rank
that died or never arrived makes the others raise after ``timeout_s`` instead of
hanging.

A call that streams data also keeps a :class:`Board` in torch.distributed's
store: ranks check in there before any process group is made (so a rank that
never comes is named), a failing rank announces its error there at once, and
every wait of the call looks at it (so no rank waits ``timeout_s`` on a peer
that has already given up); once the nodes are known, a node's ranks other than
its leader look at a page of node-shared memory instead (:class:`Node`), so
waiting costs the store about a request a second per node. :class:`Sticky` makes a call that failed in a
process fail at once when it is made again.

The modules: :mod:`.errors`, :mod:`.polling`, :mod:`.page`, :mod:`.board`, :mod:`.groups`, :mod:`.agreement`,
:mod:`.sticky`, :mod:`.control` (its collectives' bytes: :mod:`.wire`), :mod:`.kept`.
"""

from megastart.distributed.agreement import (
    Outcome,
    Started,
    agree,
    all_or_none,
    broadcast_or_raise,
    check_agreed,
    disagreement,
)
from megastart.distributed.board import PEER_GRACE_S, PROGRESS_LOOK_S, Board
from megastart.distributed.control import FANOUT, Control, make_control, node_key, tree_levels
from megastart.distributed.errors import (
    CollectiveError,
    FailedBefore,
    PeerFailed,
    Stalled,
)
from megastart.distributed.groups import LocalGroup, OwnGroups, destroy_group, new_group
from megastart.distributed.kept import discard_control, discarding_control, kept_control
from megastart.distributed.page import Node
from megastart.distributed.polling import POLL_S, polled_locally
from megastart.distributed.sticky import Sticky

__all__ = [
    "PEER_GRACE_S",
    "POLL_S",
    "PROGRESS_LOOK_S",
    "Board",
    "FANOUT",
    "CollectiveError",
    "Control",
    "FailedBefore",
    "LocalGroup",
    "Node",
    "Outcome",
    "OwnGroups",
    "PeerFailed",
    "Stalled",
    "Sticky",
    "agree",
    "check_agreed",
    "disagreement",
    "all_or_none",
    "Started",
    "broadcast_or_raise",
    "destroy_group",
    "discard_control",
    "discarding_control",
    "kept_control",
    "make_control",
    "new_group",
    "node_key",
    "polled_locally",
    "tree_levels",
]
