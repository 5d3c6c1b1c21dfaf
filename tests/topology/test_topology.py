"""The topology object: DeepSpeed's layouts, the groups it builds (a collective over each tells
its members), DeepSpeed's getters, and topologies over part of the world."""

from __future__ import annotations

import pytest

from zerotrain.testing import run_on_ranks
from zerotrain.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def test_process_topology_is_deepspeeds_row_major_layout():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]  # data peers are adjacent
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.get_rank(pipe=1, data=0) == 2 and topo.get_coord(3) == (1, 1)
    assert topo.get_dim("pipe") == 2 and topo.get_dim("model") == 0 and topo.world_size() == 4
    assert topo.filter_match(pipe=1) == [2, 3] and topo.get_axis_list("data", 1) == [1, 3]
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=2)  # argument order is not axis order
    assert three.get_axis_names() == ["pipe", "data", "model"] and three.dims == [2, 2, 3]
    assert three.get_rank(pipe=0, data=1, model=2) == 5
    assert three.get_rank_repr(5) == "model_02"
    assert three.get_rank_repr(5, omit_axes=["data"]) == "pipe_00-model_02"
    with pytest.raises(ValueError, match="needs a value for each axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="2 axes .* 1 dims"):
        ProcessTopology(["a", "b"], [2])


def _ranks_of(group):
    import torch
    import torch.distributed as dist

    # A collective over the group: each member contributes 2**rank, so the sum names the members.
    t = torch.tensor([2.0 ** dist.get_rank()])
    dist.all_reduce(t, group=group)
    return sorted(i for i in range(8) if int(t.item()) >> i & 1)


def _grid_checks():
    import torch.distributed as dist

    from zerotrain.comm.distributed import init_distributed
    from zerotrain.topology import PipelineParallelGrid, Topology
    from zerotrain.topology.topology import MESH_AXES
    from zerotrain.utils import groups

    init_distributed()
    rank = dist.get_rank()
    out = {}
    pipe2 = Topology.build(pipe=2)
    out["pipe2"] = (
        pipe2.size("pipe"),
        pipe2.size("data"),
        pipe2.size("model"),
        pipe2.rank("pipe"),
        pipe2.data_rank,
        _ranks_of(pipe2.data_group),
        _ranks_of(pipe2.group("pipe")),
        _ranks_of(pipe2.group("model")),
        _ranks_of(pipe2.distinct_group),
        pipe2.first_global_rank("data"),
        pipe2.axis_ranks("pipe"),
    )
    mesh = pipe2.mesh  # torch's DeviceMesh over the same groups
    out["mesh"] = (
        mesh.mesh.tolist(),
        mesh.mesh_dim_names,
        _ranks_of(mesh.get_group("data")),
        _ranks_of(mesh.get_group("pipe")),
    )
    # One mesh, kept; every axis group (and the distinct one) is the mesh's own.
    out["mesh_kept"] = (
        pipe2.mesh is mesh,
        _mesh_groups_are_the_topologys(pipe2),
        pipe2.size("sequence"),
        pipe2.rank("sequence"),
        _ranks_of(pipe2.group("sequence")),
        pipe2.size("tensor"),
        pipe2.group("tensor") is pipe2.group("model"),
    )
    del mesh
    model2 = Topology.build(model=2)
    out["model2"] = (
        _ranks_of(model2.data_group),
        _ranks_of(model2.group("model")),
        model2.distinct_size,
        _ranks_of(model2.distinct_group),
        model2.group("pipe") is not None,
    )
    out["model2_mesh"] = (model2.mesh.mesh.tolist(), _mesh_groups_are_the_topologys(model2))
    # pipe x model over the whole world: the distinct group spans it, and is a group of its own.
    pipe_model = Topology.build(pipe=2, model=2)
    out["pipe_model"] = (
        pipe_model.mesh.mesh.tolist(),
        _ranks_of(pipe_model.distinct_group),
        pipe_model.distinct_group is not dist.group.WORLD,
        _mesh_groups_are_the_topologys(pipe_model),
    )
    grid = PipelineParallelGrid(topology=PipeDataParallelTopology(2, 2))
    out["grid"] = (
        grid.get_stage_id(),
        grid.get_data_parallel_id(),
        grid.is_first_stage(),
        grid.is_last_stage(),
        grid.get_pipe_parallel_world_size(),
        grid.get_data_parallel_world_size(),
        _ranks_of(grid.get_data_parallel_group()),
        _ranks_of(grid.get_pipe_parallel_group()),
        grid.get_model_parallel_world_size(),
        _ranks_of(grid.get_model_parallel_group()),
        grid.stage_to_global(1),
        grid.stage_to_global(0, data=1),
        grid.p2p_groups,
    )
    default = PipelineParallelGrid()  # DeepSpeed's split of 4 ranks: pipe 2 x data 2
    out["default"] = (default.pipe_parallel_size, default.data_parallel_size)
    # Two engines' worth of groups: {0,1} and {2,3} (every rank creates both, in order).
    a, b = dist.new_group([0, 1]), dist.new_group([2, 3])
    half = Topology.from_group(a if rank < 2 else b)
    out["half"] = (
        half.members,
        half.data_rank,
        half.data_size,
        half.world_size,
        half.is_world,
        _ranks_of(half.data_group),
        half.first_global_rank("data"),
        half.is_first("data"),
    )
    # from a group too: a mesh over the group's ranks, its data axis the group itself, the
    # other axes this rank alone (created by the group's ranks only).
    out["half_mesh"] = (
        half.mesh.mesh.tolist(),
        half.mesh.mesh_dim_names,
        half.mesh.get_group("data") is half.data_group,
        half.data_group is (a if rank < 2 else b),
        _ranks_of(half.group("pipe")),
        _mesh_groups_are_the_topologys(half),
    )
    del a, b
    alone = [dist.new_group([r]) for r in range(4)][rank]
    single = Topology.from_group(alone)
    out["single"] = (
        single.mesh.mesh.tolist(),
        [single.group(axis) is alone for axis in MESH_AXES],
        single.members,
        single.data_size,
    )
    del alone
    whole = Topology.build()
    out["world_mesh"] = (
        whole.mesh.mesh.tolist(),
        whole.mesh.get_group("data") is dist.group.WORLD,
        _mesh_groups_are_the_topologys(whole),
    )
    # The groups beyond the axes come from the topology too: tied layers (a collective of the
    # world, every group in order) and the checkpoint agreement (the group's ranks alone, kept).
    tied = [pipe2.tied_group([d, d + 2], "embed") for d in range(2)][rank % 2]
    agreement = pipe2.agreement_group(pipe2.axis_ranks("data"), pipe2.data_group)
    out["more_groups"] = (
        _ranks_of(tied),
        _ranks_of(agreement),
        dist.get_backend(agreement),
        pipe2.agreement_group(pipe2.axis_ranks("data"), pipe2.data_group) is agreement,
    )
    del tied, agreement
    # DeepSpeed's global getters answer from the current topology (the world until set).
    world = groups._get_data_parallel_world_size(), _ranks_of(groups._get_data_parallel_group())
    groups._create_expert_and_data_parallel(2)
    groups._create_expert_and_data_parallel(4)
    out["experts"] = (
        world,
        groups._get_expert_parallel_world_size("ep_size_2"),
        _ranks_of(groups._get_expert_parallel_group("ep_size_2")),
        _ranks_of(groups._get_expert_data_parallel_group("ep_size_2")),
        groups._get_expert_parallel_rank("ep_size_2"),
        groups._get_expert_data_parallel_rank("ep_size_2"),
        groups._get_expert_broadcast_src_rank("ep_size_2"),
        groups._get_max_expert_size(),
        groups._get_max_expert_size_name(),
        _ranks_of(groups._get_max_expert_parallel_group()),
        sorted(groups._get_expert_parallel_group_dict()),
    )
    swapped = Topology.build()
    swapped.expert_groups(2, data_before_expert=True)
    g = swapped.expert_groups(2)
    out["data_before_expert"] = (_ranks_of(g.expert_group), _ranks_of(g.expert_data_group))
    # Expert groups split the mesh's data axis; one over the whole world is still a group of its own.
    e4 = groups._get_expert_parallel_group("ep_size_4")
    e2 = swapped.expert_groups(2)
    out["expert_mesh"] = (
        e2.mesh.mesh_dim_names,
        e2.mesh.get_group("expert") is e2.expert_group,
        e2.mesh.get_group("expert_data") is e2.expert_data_group,
        e4 is not dist.group.WORLD,
    )
    del e4, e2, g
    try:
        groups._get_expert_parallel_group("ep_size_3")
    except KeyError as error:
        out["unknown"] = str(error)
    # Nothing of the topology keeps a group alive past destroy_process_group(): the mesh's cache
    # of groups empties with torch's registry, and asking for a group says it is gone.
    import gc

    dist.destroy_process_group()
    gc.collect()
    out["after_destroy"] = [len(t.mesh._pg_registry) for t in (pipe2, model2, pipe_model, whole, swapped)]
    try:
        pipe2.group("data")
    except RuntimeError as error:
        out["destroyed"] = str(error)
    return out


def _mesh_groups_are_the_topologys(topology) -> bool:
    from zerotrain.topology.topology import MESH_AXES

    mesh = topology.mesh
    same = all(mesh.get_group(axis) is topology.group(axis) for axis in MESH_AXES)
    if topology.distinct_group is not None:
        same = same and mesh.get_group("distinct") is topology.distinct_group
    return same and mesh.mesh_dim_names == MESH_AXES


def test_four_ranks_groups_follow_the_layout():
    results = run_on_ranks(_grid_checks, world_size=4, timeout=300)
    for rank, out in enumerate(results):
        pipe, data = divmod(rank, 2)
        members = [0, 1] if rank < 2 else [2, 3]
        assert out["pipe2"] == (
            2,
            2,
            1,
            pipe,
            data,
            [2 * pipe, 2 * pipe + 1],
            [data, data + 2],
            [rank],
            [data, data + 2],
            2 * pipe,
            [data, data + 2],
        )
        # model fastest: model groups are adjacent ranks, data groups stride by 2
        assert out["model2"] == (
            [rank % 2, rank % 2 + 2],
            [2 * (rank // 2), 2 * (rank // 2) + 1],
            2,
            [2 * (rank // 2), 2 * (rank // 2) + 1],
            True,
        )
        assert out["grid"] == (
            pipe,
            data,
            pipe == 0,
            pipe == 1,
            2,
            2,
            [2 * pipe, 2 * pipe + 1],
            [data, data + 2],
            2,
            [data, data + 2],
            2 + data,
            1,
            [[0, 2], [1, 3], [2, 0], [3, 1]],
        )
        assert out["default"] == (2, 2)
        # pipe x data x sequence x model, model fastest (sequence and model of size 1 here)
        assert out["mesh"] == (
            [[[[0]], [[1]]], [[[2]], [[3]]]],
            ("pipe", "data", "sequence", "model"),
            [2 * pipe, 2 * pipe + 1],
            [data, data + 2],
        )
        assert out["mesh_kept"] == (True, True, 1, 0, [rank], 1, True)
        assert out["model2_mesh"] == ([[[[0, 1]], [[2, 3]]]], True)
        assert out["pipe_model"] == ([[[[0, 1]]], [[[2, 3]]]], [0, 1, 2, 3], True, True)
        assert out["half_mesh"] == (
            [[[[members[0]]], [[members[1]]]]],
            ("pipe", "data", "sequence", "model"),
            True,
            True,
            [rank],
            True,
        )
        assert out["single"] == ([[[[rank]]]], [True] * 4, [rank], 1)
        assert out["world_mesh"] == ([[[[0]], [[1]], [[2]], [[3]]]], True, True)
        assert out["more_groups"] == ([data, data + 2], [2 * pipe, 2 * pipe + 1], "gloo", True)
        assert out["expert_mesh"] == (("pipe", "expert", "expert_data", "sequence", "model"), True, True, True)
        assert out["after_destroy"] == [0, 0, 0, 0, 0]
        assert "was destroyed" in out["destroyed"]
        assert out["half"] == (members, rank % 2, 2, 2, False, members, members[0], rank % 2 == 0)
        # DeepSpeed's docstring layout: expert groups contiguous, expert-data groups strided
        ep = [2 * (rank // 2), 2 * (rank // 2) + 1]
        edp = [rank % 2, rank % 2 + 2]
        assert out["experts"] == (
            (4, [0, 1, 2, 3]),
            2,
            ep,
            edp,
            rank % 2,
            rank // 2,
            rank % 2,
            4,
            "ep_size_4",
            [0, 1, 2, 3],
            ["ep_size_2", "ep_size_4"],
        )
        assert out["data_before_expert"] == (edp, ep)
        assert "ep_size_3" in out["unknown"] and "ep_size_2, ep_size_4" in out["unknown"]


def _bad_sizes():
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.topology import Topology

    init_distributed()
    errors = []
    for kwargs in ({"pipe": 3}, {"pipe": 2, "data": 2}):
        try:
            Topology.build(**kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_sizes_that_do_not_fit_the_world_name_the_fix():
    errors = run_on_ranks(_bad_sizes, world_size=2)[0]
    assert "do not divide into pipe=3" in errors[0]
    assert "pipe=2 x data=2 x model=1 is not the world size 2" in errors[1]
