"""The configurations the mpirun correctness suite runs (tests/launch_worker.py), named so
that tests/test_mpi.py reports each as its own test."""

from __future__ import annotations


def cases(world: int):
    """(name, ranks per host, Config fields)."""
    out = []
    algorithms = ("SRA", "Ring")
    if world == 2:
        for inner in ("SHM", "MPI", "GLOO"):
            for alg in algorithms:
                out.append((f"1x2-{inner}-{alg}", 2,
                            dict(inner_communicator=inner, inner_reduction=alg)))
        for cross in ("MPI", "GLOO"):
            for alg in algorithms:
                out.append((f"2x1-{cross}-{alg}", 1,
                            dict(cross_communicator=cross, cross_reduction=alg)))
    else:
        for inner in ("SHM", "MPI", "GLOO"):
            for cross in ("MPI", "GLOO"):
                for inner_alg in algorithms:
                    for cross_alg in algorithms:
                        out.append((f"2x2-{inner}-{cross}-{inner_alg}-{cross_alg}", 2,
                                    dict(inner_communicator=inner, cross_communicator=cross,
                                         inner_reduction=inner_alg, cross_reduction=cross_alg)))
        out += [
            ("2x2-leader-SHM-MPI", 2, dict(cross_communicator="MPI", intra_broadcast=True)),
            ("2x2-leader-MPI-GLOO-Ring", 2, dict(inner_communicator="MPI", intra_broadcast=True,
                                                 inner_reduction="Ring")),
            ("2x2-raw-intra-SHM-MPI", 2, dict(cross_communicator="MPI", intra_compress=False)),
            ("2x2-stochastic-SHM-MPI-Ring", 2, dict(cross_communicator="MPI",
                                                    stochastic_rounding=True, seed=7,
                                                    inner_reduction="Ring",
                                                    cross_reduction="Ring")),
            ("1x4-MPI-Ring", 4, dict(inner_communicator="MPI", inner_reduction="Ring")),
            ("4x1-MPI-SRA", 1, dict(cross_communicator="MPI")),
        ]
    return out
