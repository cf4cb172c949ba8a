"""Hardware: the DeviceGraph (devices, links, switches, derived routes) and its presets."""
