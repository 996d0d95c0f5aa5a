"""Where settings come from: paths and discovery, the inventory of hosts, the drafter catalog, ssh_config."""
