"""The command bus: the named commands the CLI (over the control socket) and the HTTP front end
run against the core (status, restart, load, train.job, …), and the CLI's client for them."""
