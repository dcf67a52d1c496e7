"""NCCL fabric settings for job files: a preset per interconnect (`cluster.nccl_preset`), then `cluster.nccl_env`.

The presets are starting points that work on common fabrics, not tuning:
- `infiniband`: NCCL over IB verbs on the mlx5 HCAs (GPUDirect RDMA when the driver allows), bootstrap over
  any interface but loopback and docker bridges.
- `roce`: the same over RoCE v2, which needs the GID index of the RoCE v2 address (3 on most Mellanox/NVIDIA
  set-ups) and a traffic class that the switches treat as lossless (106 is the common DSCP 26 mapping).
- `efa`: AWS Elastic Fabric Adapter, which NCCL reaches only through the aws-ofi-nccl plugin (libfabric's `efa`
  provider, in the image or on the node): `NCCL_NET` names the plugin so a missing plugin fails at start instead
  of falling back to TCP silently, GPUDirect RDMA on (p4d/p5), fork-safe verbs (the DataLoader forks). On
  Kubernetes also request the devices: `cluster.k8s_rdma_resource: vpc.amazonaws.com/efa` (one per NIC).
- `tcp`: no IB; more sockets and threads per connection, which TCP needs to fill a 100+ Gb/s link.
Check the HCA names (`ibv_devices`), the GID index (`show_gids`) and the interface names on the cluster, and
put what differs in `cluster.nccl_env`.
"""

from __future__ import annotations

from leantrain.spec import JobSpec

BOOTSTRAP_IFNAME = "^lo,docker"
NCCL_PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "infiniband": {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": BOOTSTRAP_IFNAME,
                   "NCCL_NET_GDR_LEVEL": "PHB"},
    "roce": {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5", "NCCL_IB_GID_INDEX": "3", "NCCL_IB_TC": "106",
             "NCCL_SOCKET_IFNAME": BOOTSTRAP_IFNAME},
    "efa": {"NCCL_NET": "AWS Libfabric", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "RDMAV_FORK_SAFE": "1",
            "NCCL_SOCKET_IFNAME": BOOTSTRAP_IFNAME},
    "tcp": {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": BOOTSTRAP_IFNAME, "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "4"},
}


def nccl_env(spec: JobSpec) -> dict[str, str]:
    """The fabric variables every node exports: the preset, overridden and extended by `cluster.nccl_env`."""
    return {**NCCL_PRESETS[spec.cluster.nccl_preset], **spec.cluster.nccl_env}
