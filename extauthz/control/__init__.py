"""Control: the stored documents the engine applies (switches, overrides), who changed
them (the change log), one customer's view, and the control path the admin
routes and the operator commands use."""
