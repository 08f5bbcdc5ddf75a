"""TierFS data plane: the framed binary protocol, its transports (tcp, shm,
rdma) and the client with a connection pool per peer. The server lives in
:mod:`tierfs.storage.dataplane`."""

from tierfs.net.client import Address, DataClient, ReadItem, WriteItem, parse_address
from tierfs.net.framing import FrameProtocol
from tierfs.net.memstore import MemoryFragmentStore
from tierfs.net.protocol import (
    ALL,
    HEADER_FORMAT,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Flag,
    Header,
    Limits,
    Op,
    decode_header,
    encode_header,
)
from tierfs.net.transport import Listener, Transport, get_transport, transport_names

__all__ = [
    "ALL",
    "HEADER_FORMAT",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "Address",
    "DataClient",
    "Flag",
    "FrameProtocol",
    "Header",
    "Limits",
    "Listener",
    "MemoryFragmentStore",
    "Op",
    "ReadItem",
    "Transport",
    "WriteItem",
    "decode_header",
    "encode_header",
    "get_transport",
    "parse_address",
    "transport_names",
]
