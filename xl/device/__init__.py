"""Device sizing: what a run holds on its device (:mod:`xl.device.footprint`), how that compares with the device's
memory (:mod:`xl.device.headroom`), and what the CPU computes natively (:mod:`xl.device.cpu`)."""
