"""A first refit program in Python: device 0 holds a [4, 6] float weight; device 1 needs its right
half (columns 3..6, a tensor-parallel shard) in a [4, 3] buffer of its own. Plan it, run the plan's
routes, check the bytes. Runs on the host backend (host memory standing in for two GPUs); with
GPUs, pass tensors' data_ptr() and leave the backend to AUTO.  `pip install ./python`, then run it."""

import ctypes

import refit

weight = (ctypes.c_float * 24)(*[10 * (i // 6) + i % 6 for i in range(24)])
shard = (ctypes.c_float * 12)()

with refit.Table() as publisher, refit.Table() as receiver:
    t = publisher.add_tensor("w", shape=(4, 6), elem_size=4)
    publisher.add_offer(t, rank=0, device=0, addr=ctypes.addressof(weight), offset=(0, 0), extent=(4, 6))
    t = receiver.add_tensor("w", shape=(4, 6), elem_size=4)
    receiver.add_need(t, rank=0, device=1, addr=ctypes.addressof(shard), offset=(0, 3), extent=(4, 3), strides=(3, 1))
    plan = refit.Plan.build([publisher, receiver])

with plan, refit.Group([0, 1], backend=refit.Backend.HOST) as group:
    for route in plan.routes():
        group.copy_batch(route.dst_device, route.segments)
    assert list(shard) == [weight[6 * r + 3 + c] for r in range(4) for c in range(3)], list(shard)
    print(f"refit {refit.version()}: {plan.route_count} route(s) moved the right half of w to device 1")
