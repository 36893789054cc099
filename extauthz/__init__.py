"""extauthz: an Envoy external authorization server that rate limits and sheds load.

The engine (classification, limiters, shedders, stores) is plain Python and does not
import grpc; only :mod:`extauthz.server` speaks Envoy's protocols.
"""

__version__ = "0.1.0"
