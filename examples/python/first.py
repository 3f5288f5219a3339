"""Device 0 holds a [4, 6] float weight; device 1 needs its right half (columns 3..6, a tensor-parallel
shard) in a [4, 3] buffer of its own. Plan once, prepare an executor once, then each step: run (into
staging, verified), commit (into the live buffer). Host backend: host memory stands in for two GPUs
(with GPUs: tensors' data_ptr(), or refit.tensor.add_tensor_offer / add_tensor_need)."""

import ctypes

import refit

weight, shard = (ctypes.c_float * 24)(*range(24)), (ctypes.c_float * 12)()

# 1. Plan: what each side holds and needs, by device ordinal.
with refit.Table() as publisher, refit.Table() as receiver:
    t = publisher.add_tensor("w", shape=(4, 6), elem_size=4)
    publisher.add_offer(t, rank=0, device=0, addr=ctypes.addressof(weight), offset=(0, 0), extent=(4, 6))
    t = receiver.add_tensor("w", shape=(4, 6), elem_size=4)
    receiver.add_need(t, 0, 1, ctypes.addressof(shard), offset=(0, 3), extent=(4, 3), strides=(3, 1))
    plan = refit.Plan.build([publisher, receiver])

# 2. Executor: this process's share of the plan on a group of its devices, prepared once.
with plan, refit.Group([0, 1], backend=refit.Backend.HOST) as group:
    with plan.executor(group, process=0, verify=True, commit=refit.Commit.STAGED) as executor:
        # 3. One step (repeat it whenever the weights change): run into staging, then commit.
        run = executor.run()
        assert list(shard) == [0.0] * 12, "a staged run leaves the live buffer alone"
        commit = executor.commit()
        assert list(shard) == [weight[6 * (i // 3) + 3 + i % 3] for i in range(12)]
        print(
            f"refit {refit.version()}: {run.verified_bytes} bytes verified in staging, "
            f"{commit.installed_bytes} installed by the commit"
        )
