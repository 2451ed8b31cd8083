"""Models without a hub, devices, host memory, torch threads and padded batches: what every other wing builds on."""
