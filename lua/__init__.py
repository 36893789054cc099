"""The Redis Lua scripts, shipped in the wheel as the ``extauthz.lua`` package data."""
