"""Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
shard) in a [4, 3] buffer of its own. Plan, run the routes, check. Host backend: host memory stands in
for two GPUs (with GPUs: tensors' data_ptr(), or refit.tensor.add_tensor_offer / add_tensor_need)."""

import ctypes

import refit

weight, shard = (ctypes.c_float * 24)(*range(24)), (ctypes.c_float * 12)()
with refit.Table() as publisher, refit.Table() as receiver:
    t = publisher.add_tensor("w", shape=(4, 6), elem_size=4)
    publisher.add_offer(t, rank=0, device=0, addr=ctypes.addressof(weight), offset=(0, 0), extent=(4, 6))
    t = receiver.add_tensor("w", shape=(4, 6), elem_size=4)
    receiver.add_need(t, 0, 1, ctypes.addressof(shard), offset=(0, 3), extent=(4, 3), strides=(3, 1))
    plan = refit.Plan.build([publisher, receiver])

with plan, refit.Group([0, 1], backend=refit.Backend.HOST) as group:
    for route in plan.routes():
        group.copy_batch(route.dst_device, route.segments)
    assert list(shard) == [weight[6 * (i // 3) + 3 + i % 3] for i in range(12)]
    print(f"refit {refit.version()}: {plan.route_count} route(s) moved the right half of w to device 1")
