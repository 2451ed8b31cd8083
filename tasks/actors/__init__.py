"""The Ray actors that host the engines, one module per role, their pools and their process set-up."""
