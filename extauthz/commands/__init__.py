"""The ``extauthz`` commands: serve, the operator commands, simulate, pictures, k8s."""
