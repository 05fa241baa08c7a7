"""A vLLM KV connector for graph mode's tuple caches: prefill on one vLLM, decode on another.

``LLM(..., kv_transfer_config={"kv_connector": "TupleCacheConnector", "kv_connector_module_path":
"ascend_graph.vllm.kv_connector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
"kv_port": PORT, "kv_connector_extra_config": {"host": HOST, "secret_file": PATH}})`` with graph
mode on; producer and consumer share the secret (``secret_file``, else ``$ASCEND_GRAPH_PD_SECRET``;
no default: the connector refuses to start without one); docs/vllm.md, "PD between two vLLM
instances". vLLM's own connectors register the tensors vLLM allocated, which graph mode releases; this one registers the runner's ``MLACache`` /
``KVCache`` tensors (the ones its graphs captured) with Mooncake's transfer engine.

Protocol: a request sent to the producer with ``kv_transfer_params {"do_remote_decode": True}``
keeps its blocks when it finishes; its output's ``kv_transfer_params`` (``do_remote_prefill``,
the producer's request id, block ids, control address and engine id) go with the same prompt to
the consumer, whose scheduler reports the prompt as external tokens loaded asynchronously. The
producer registers its caches with a Mooncake transport (``pd/mooncake.py``) and answers the
consumer's layout request on its authenticated control server (``kv_transfer``). The consumer's
worker handshakes once per producer instance (layouts and model identity checked: the
``model_identity`` hook of the model's cache layers), pulls each request's blocks
(``pd.layout.plan_transfer``, within ``kv_connector_extra_config["load_timeout_s"]``), tells
the producer ``done`` and reports the request received if the producer answers that the
request's lease was still held. A failed pull, or an expired lease, reports the request's
blocks invalid, in the same step as the request and, where reads were left in flight, only once
the broken transport has settled (``kv_transfer.Puller``); vLLM then fails the request or, with
``kv_load_failure_policy="recompute"``, recomputes it. The producer frees a request's blocks at
its first step after ``done``, or once its lease expires (``send_timeout_s``), whichever
``kv_transfer.Leases`` decides first; a ``done`` after the expiry is answered ``expired``.
Tensor and pipeline parallelism are not supported (graph mode rejects them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.request import RequestStatus

from ..pd.auth import SECRET_ENV, secret_from
from ..pd.select import open_transport
from ..pd.transport import Transport
from . import kv_transfer as kt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
STATS_METHOD = "ascend_graph_kv_transfer_stats"  # added to vLLM's WorkerBase, called by name
EXTRA_KEYS = ("host", "secret_file", "send_timeout_s", "load_timeout_s")  # kv_connector_extra_config


@dataclass
class Load:
    """One request's pull: its local blocks and the producer's, and where the producer listens."""

    request_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    remote_request_id: str
    host: str
    port: int
    engine_id: str  # the producer's kv_transfer_config.engine_id: its control server must answer with it


@dataclass
class TupleCacheMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)  # producer request ids now holding blocks for a consumer


class TupleCacheConnector(KVConnectorBase_V1):
    """Both halves: the scheduler side decides what moves, the worker side moves it."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = vllm_config.kv_transfer_config
        _check_extra_config(config.kv_connector_extra_config or {})
        self._secret = secret_from(secret_file=config.get_from_extra_config("secret_file", None),
                                   what='TupleCacheConnector: set kv_connector_extra_config["secret_file"] (a file '
                                        'holding the secret the producer and consumer share)')
        self._host = str(config.get_from_extra_config("host", "127.0.0.1"))
        self._port = int(config.kv_port)
        self._engine_id = str(config.engine_id)  # one per instance, shared by both halves
        self._block_size = vllm_config.cache_config.block_size
        self._producer, self._consumer = config.is_kv_producer, config.is_kv_consumer
        self._send_timeout_s = _seconds(config, "send_timeout_s", 120.0)
        self._load_timeout_s = _seconds(config, "load_timeout_s", 20.0)
        # scheduler side
        self._loads: dict[str, Load] = {}
        self._sends: list[str] = []
        self._matched_from: dict[str, int] = {}  # request id -> locally computed tokens at the match
        # worker side
        self._worker: Optional[_Worker] = _Worker(self) if role == KVConnectorRole.WORKER else None

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (self._consumer and params.get("do_remote_prefill")):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        self._matched_from[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one pull per request
        if num_external_tokens <= 0:
            return
        first = self._matched_from.pop(request.request_id, 0) // self._block_size
        last = -(-len(request.prompt_token_ids or ()) // self._block_size)
        local, remote = blocks.get_block_ids()[0][first:last], list(params["remote_block_ids"])[first:last]
        self._loads[request.request_id] = Load(request.request_id, list(local), remote,
                                               str(params["remote_request_id"]), str(params["remote_host"]),
                                               int(params["remote_port"]), str(params["remote_engine_id"]))

    def build_connector_meta(self, scheduler_output: Any) -> TupleCacheMetadata:
        meta = TupleCacheMetadata(loads=list(self._loads.values()), sends=self._sends)
        self._loads, self._sends = {}, []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """A producer's finished request keeps its blocks for the consumer; its output carries
        what the consumer needs to pull them."""
        params = request.kv_transfer_params or {}
        self._matched_from.pop(request.request_id, None)
        if not (self._producer and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None
        self._sends.append(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_request_id": request.request_id, "remote_block_ids": list(block_ids),
                      "remote_host": self._host, "remote_port": self._port, "remote_engine_id": self._engine_id}

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._require_worker().register(list(kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TupleCacheMetadata)
        worker = self._require_worker()
        worker.hold(meta.sends)
        for load in meta.loads:
            worker.load(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the consumer pulls: nothing to push

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self._require_worker().finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._require_worker().take_invalid_blocks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _require_worker(self) -> "_Worker":
        if self._worker is None:
            raise RuntimeError("TupleCacheConnector: a worker-side method was called on the scheduler side")
        return self._worker


class _Worker:
    """The worker half: the producer's registered caches and control server, the consumer's pulls."""

    def __init__(self, connector: TupleCacheConnector) -> None:
        self.c = connector
        self.source: Optional[Transport] = None  # producer: serves reads of its registered caches
        self.puller: Optional[kt.Puller] = None  # consumer
        self.server: Optional[kt.ControlServer] = None
        self.leases = kt.Leases(connector._send_timeout_s)  # producer: held requests' blocks
        self.identity = None  # this instance's model identity (pd/identity.py), once registered
        self.invalid: set[int] = set()
        self.stats = {"requests_loaded": 0, "blocks_loaded": 0, "bytes_loaded": 0, "descriptors": 0,
                      "load_seconds": 0.0, "load_failures": 0, "requests_sent": 0, "regions": 0,
                      "transports_opened": 0, "leases_expired": 0, "expired_pulls": 0, "control": {}}
        _add_worker_method()

    def register(self, layer_names: list[str]) -> None:
        """Register each layer's tuple cache, in layer order; start serving them (producer)."""
        context = self.c._vllm_config.compilation_config.static_forward_context
        caches = []
        for name in sorted(layer_names, key=extract_layer_index):
            tuple_cache = getattr(context.get(name), "tuple_cache", None)
            if tuple_cache is None:
                raise ValueError(f"TupleCacheConnector moves ascend_graph's graph-mode caches; layer {name} is "
                                 "not one (turn graph mode on: additional_config={'torchair_graph_config': "
                                 "{'enabled': True}}, or use one of vLLM's connectors)")
            caches.append(tuple_cache())  # the runner's MLACache / KVCache: the tensors its graphs captured
        self.identity = _identity(context, layer_names)
        if self.c._consumer:
            self.puller = kt.Puller(caches, self.c._secret, self.c._host, self.c._load_timeout_s,
                                    identity=self.identity)
            self.stats["regions"] = len(self.puller.layout.regions)
        if self.c._producer:
            self.source = open_transport("mooncake", "source", self.c._host)
            self.stats["regions"] = len(self.source.register(caches).regions)
            self.server = kt.ControlServer(self.c._host, self.c._port, self.answer, self.c._secret)

    def answer(self, message: dict) -> dict:
        """The control server's handler (its threads); ``message`` passed ``kt.REQUESTS``."""
        if message["op"] == "layout":
            return kt.layout_reply(self.source, self.c._engine_id, self.identity)
        return {"lease": self.leases.done(message["request_id"])}

    def hold(self, request_ids: list[str]) -> None:
        self.leases.hold(request_ids)

    def load(self, load: Load) -> None:
        """Pull one request's blocks; a failure reaches vLLM through ``finished`` (it then recomputes)."""
        if self.puller is None:
            raise RuntimeError("TupleCacheConnector: a load on an instance that is not a kv_consumer")
        start = time.perf_counter()
        producer = kt.Producer(load.host, load.port, load.engine_id)
        plan = self.puller.load(load.request_id, producer, load.remote_request_id, load.remote_blocks,
                                load.local_blocks)
        if plan is None:
            self.stats["load_failures"] += 1
        else:
            self.stats["requests_loaded"] += 1
            self.stats["blocks_loaded"] += len(load.local_blocks)
            self.stats["bytes_loaded"] += plan.num_bytes
            self.stats["descriptors"] += plan.num_descriptors
        self.stats["load_seconds"] += time.perf_counter() - start
        self.stats["transports_opened"] = self.puller.transports_opened
        self.stats["expired_pulls"] = self.puller.expired_pulls

    def finished(self) -> tuple[Optional[set[str]], Optional[set[str]]]:
        sent = self.leases.finished()  # done or expired: vLLM may free their blocks now
        self.stats["requests_sent"] += len(sent)
        self.stats["leases_expired"] = self.leases.expired
        if self.server is not None:
            self.stats["control"] = dict(self.server.counters)
        received: set[str] = set()
        if self.puller is not None:  # a failed request's blocks are reported in the same pass as it
            received, invalid = self.puller.take_finished()
            self.invalid |= invalid
        return sent or None, received or None

    def take_invalid_blocks(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.puller is not None:
            self.puller.close()
        if self.source is not None:
            self.source.close()


def _check_extra_config(extra: dict) -> None:
    if "secret" in extra:
        raise ValueError('kv_connector_extra_config["secret"]: vLLM logs its config; put the secret in a file and '
                         f'name it with "secret_file" (or set ${SECRET_ENV})')
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} for "
                         f"TupleCacheConnector (it reads {', '.join(EXTRA_KEYS)})")


def _identity(context: dict, layer_names: list[str]):
    """The model identity from the cache layers' ``model_identity`` hook (set by the model)."""
    hooks = {getattr(context.get(name), "model_identity", None) for name in layer_names}
    if None in hooks or len(hooks) != 1:
        raise ValueError("TupleCacheConnector needs the model's identity for its handshake: every cache layer's "
                         "model_identity hook must be set, to one function (ascend_graph.vllm.model sets it)")
    return hooks.pop()()


def _seconds(config: Any, key: str, default: float) -> float:
    value = float(config.get_from_extra_config(key, default))
    if not value > 0:
        raise ValueError(f'kv_connector_extra_config["{key}"] must be > 0 seconds, got {value}')
    return value


def _add_worker_method() -> None:
    """``WorkerBase.ascend_graph_kv_transfer_stats``: the worker connector's counters, by name."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, STATS_METHOD):
        setattr(WorkerBase, STATS_METHOD, lambda worker: dict(get_kv_transfer_group()._worker.stats))


def transfer_stats(llm: Any) -> dict:
    """The worker connector's counters of ``llm`` (blocks and bytes loaded, requests sent, ...)."""
    (stats,) = llm.collective_rpc(STATS_METHOD)
    return stats
