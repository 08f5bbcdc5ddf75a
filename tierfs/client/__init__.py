"""Client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio), file
objects, and the pieces behind them (codec, routing cache, fan-out)."""

from tierfs.client.client import AsyncClient, FileStat
from tierfs.client.codec import Codec, codec_for
from tierfs.client.config import ClientConfig
from tierfs.client.file import AsyncFile
from tierfs.client.sync import Client, File

__all__ = ["AsyncClient", "AsyncFile", "Client", "ClientConfig", "Codec", "File", "FileStat", "codec_for"]
