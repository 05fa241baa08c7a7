"""``ascend_graph.vllm.kv_transfer`` without vLLM: block runs, descriptors, the control channel,
and a pull between two Mooncake engines (TCP, 127.0.0.1, one process) checked byte for byte.

The pull between two vLLM instances is tests/test_vllm_pd.py. The engine test is skipped without
Mooncake, except where ``$ASCEND_GRAPH_REQUIRE_VLLM`` is set (CI), where that fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ascend_graph.vllm import kv_transfer as kt


def _caches(layers: int, blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(blocks, 16, 1, 512, generator=g), torch.randn(blocks, 16, 1, 64, generator=g))
            for _ in range(layers)]


def test_block_runs_merge_what_is_contiguous_on_both_sides():
    assert kt.block_runs([10, 11, 12, 20], [3, 4, 5, 6]) == [(10, 3, 3), (20, 6, 1)]
    assert kt.block_runs([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    assert kt.block_runs([], []) == []
    with pytest.raises(ValueError, match="2 local blocks against 1 remote"):
        kt.block_runs([1, 2], [1])


def test_descriptors_address_each_run_in_each_tensor_and_check_the_layout():
    local, remote = kt.regions_of(_caches(2, 8, 0)), kt.regions_of(_caches(2, 4, 1))
    assert [r.block_bytes for r in local] == [16 * 512 * 4, 16 * 64 * 4] * 2
    mine, theirs, lengths = kt.descriptors(local, remote, [(5, 1, 2)])
    assert len(mine) == 4  # one run, four tensors
    assert mine == [r.addr + 5 * r.block_bytes for r in local]
    assert theirs == [r.addr + 1 * r.block_bytes for r in remote]
    assert lengths == [2 * r.block_bytes for r in local]
    with pytest.raises(ValueError, match="out of range"):
        kt.descriptors(local, remote, [(5, 3, 2)])  # remote has 4 blocks
    other = kt.regions_of([(torch.zeros(4, 16, 1, 512), torch.zeros(4, 16, 1, 32))] * 2)
    with pytest.raises(ValueError, match="layouts differ"):
        kt.descriptors(local, other, [(0, 0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        kt.regions_of([(torch.zeros(4, 16, 1, 512).transpose(0, 1),)])
    assert kt.regions_from_json(kt.regions_to_json(local)) == local


def test_batches_cut_at_the_limit():
    addrs = (list(range(1100)), list(range(1100)), [1] * 1100)
    assert [len(b[0]) for b in kt.batches(addrs)] == [512, 512, 76]


def test_control_server_answers_and_reports_errors():
    seen = []

    def handler(message):
        if message["op"] == "bad":
            raise KeyError("nope")
        seen.append(message)
        return {"echo": message["op"]}

    server = kt.ControlServer("127.0.0.1", 0, handler)
    try:
        host, port = server.address
        assert kt.ask(host, port, {"op": "layout"}) == {"echo": "layout"}
        with pytest.raises(ConnectionError, match="KeyError"):
            kt.ask(host, port, {"op": "bad"})
        assert seen == [{"op": "layout"}]
    finally:
        server.close()


def test_a_pull_between_two_engines_copies_exactly_the_requested_blocks():
    if importlib.util.find_spec("mooncake") is None:
        message = "no Mooncake: pip install mooncake-transfer-engine-non-cuda"
        if os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
            pytest.fail(message)
        pytest.skip(message)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    prefill, decode = _caches(3, 32, 0), _caches(3, 24, 1)
    before = [[t.clone() for t in layer] for layer in decode]
    pointers = [[t.data_ptr() for t in layer] for layer in decode]
    p_engine, d_engine = kt.new_engine("127.0.0.1"), kt.new_engine("127.0.0.1")
    p_regions, d_regions = kt.regions_of(prefill), kt.regions_of(decode)
    kt.register(p_engine, p_regions)
    kt.register(d_engine, d_regions)
    local, remote = [10, 11, 12, 20, 5], [3, 7, 8, 9, 31]
    addrs = kt.descriptors(d_regions, p_regions, kt.block_runs(local, remote))
    assert len(addrs[0]) == 3 * 2 * 4  # runs: 10<-3, 11..12<-7..8, 20<-9, 5<-31
    nbytes = kt.read_blocks(d_engine, f"127.0.0.1:{p_engine.get_rpc_port()}", addrs)
    assert nbytes == len(local) * 16 * (512 + 64) * 4 * 3
    rest = [b for b in range(24) if b not in local]
    for i in range(3):
        for j in range(2):
            assert torch.equal(decode[i][j][local], prefill[i][j][remote])
            assert torch.equal(decode[i][j][rest], before[i][j][rest])  # nothing else written
            assert decode[i][j].data_ptr() == pointers[i][j]
    with pytest.raises(RuntimeError, match="returned"):  # a peer address nothing registered
        kt.read_blocks(d_engine, f"127.0.0.1:{p_engine.get_rpc_port()}",
                       ([d_regions[0].addr], [4096], [64]))
