"""What a training costs: memory and the device facts (:mod:`.memory`), FLOPs and MFU (:mod:`.flops`),
and what other processes took of the machine meanwhile (:mod:`.outside_load`)."""
