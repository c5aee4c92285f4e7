"""Bad arguments give clear errors that name what is wrong, and leave the world working; a
broken world raises WorldBrokenError from pending and new ops."""

from __future__ import annotations

from tests.support.worker_support import TEST_DETECT, assignment, free_ports

# case -> (an error type it must be, words its message must hold)
REFUSALS = {
    "not_a_tensor": ("TypeError", "tensor must be a torch.Tensor, got list"),
    "non_contiguous": ("ValueError", "tensor must be contiguous"),
    "dst_out_of_range": ("ValueError", "dst=2 is out of range for world 'w' of size 2"),
    "src_negative": ("ValueError", "src=-1 is out of range"),
    "send_to_self": ("ValueError", "own rank in world 'w'"),
    "send_not_a_tensor": ("TypeError", "tensor must be a torch.Tensor, got list"),
    "recv_non_contiguous": ("ValueError", "tensor must be contiguous"),
    "send_non_contiguous_async": ("ValueError", "tensor must be contiguous"),
    "send_dst_bool": ("TypeError", "dst must be an int rank, got"),
    "dst_not_int": ("TypeError", "dst must be an int rank"),
    "broadcast_src_out_of_range": ("ValueError", "src=5 is out of range"),
    "all_gather_short_list": ("ValueError", "tensor_list must hold 2 tensors"),
    "all_gather_shape": ("ValueError", "tensor_list[0] has shape (2,)"),
    "all_gather_dtype": ("ValueError", "dtype torch.int64, but tensor has shape (1,) and dtype torch.float32"),
    "all_gather_list_item": ("TypeError", "tensor_list[1] must be a torch.Tensor, got str"),
    "all_gather_not_a_tensor": ("TypeError", "tensor must be a torch.Tensor, got float"),
    "gather_list_missing_on_dst": ("ValueError", "gather_list is required"),
    "gather_list_on_other_rank": ("ValueError", "gather_list must be None or empty"),
    "scatter_shape": ("ValueError", "scatter_list[0] has shape (3,)"),
    "reduce_scatter_dtype": ("ValueError", "input_list[0] has shape (1,) and dtype torch.int32"),
    "all_to_all_dtype": ("ValueError", "input_tensor_list[0] has torch.int64"),
    "bad_reduce_op": ("ValueError", "op must be a ReduceOp"),
    "avg_on_gloo": ("NotImplementedError", "all_reduce is not supported by the gloo backend (ReduceOp.AVG)"),
    "unknown_world": ("KeyError", "unknown world 'no-such-world': this process holds 'w'"),
    "leave_unknown_world": ("ValueError", "unknown world 'no-such-world'"),
    "rank_out_of_range": ("ValueError", "rank 2 is out of range for size 2"),
    "same_epoch_changed": ("WorldJoinError", "a changed world needs a new epoch"),
}


def test_bad_arguments_and_ops_on_a_broken_world(spawn) -> None:
    (port,) = free_ports(1)
    members = [
        spawn("bad_args", {"pod": f"p{rank}", "detect": TEST_DETECT, "world": assignment("w", rank, 2, port)})
        for rank in range(2)
    ]
    for member in members:
        member.wait_for("still_works")
        assert not member.named("accepted"), member.named("accepted")
        refused = {e["case"]: e for e in member.named("refused")}
        assert set(refused) == set(REFUSALS)
        for case, (error_type, words) in REFUSALS.items():
            assert error_type in refused[case]["types"], (case, refused[case])
            assert words in refused[case]["message"], (case, refused[case]["message"])
        assert member.named("still_works")[0]["value"] == [2.0]

    leader, leaver = members
    leaver.tell("go")
    leaver.wait_for("left")
    pending = leader.wait_for("pending_raised")
    assert pending["world"] == "w" and pending["epoch"] == 1
    assert pending["reason"] == "rank 1 left the world (verdict of rank 1)"
    assert leader.wait_for("new_raised")["broken"] is True
    leaver.tell("done")
    for name, member in zip(("leader", "leaver"), members, strict=True):
        assert member.wait_exit() == 0, (name, member.stderr())
