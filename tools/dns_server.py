"""A real DNS server on 127.0.0.1 whose records a test changes while it runs, for --discovery dns://.

Needs dnslib (the ``dev`` extra): used by the tests and the recovery matrix, never by the store.
"""

from __future__ import annotations

import threading

import dns.reversename
from dnslib import AAAA, PTR, QTYPE, RCODE, RR, A, DNSError, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

RDATA = {"A": A, "AAAA": AAAA, "PTR": PTR}
SILENT = "not answering (Zone.answering is False)"  # the reason a query is dropped, kept out of the log


def ptr_name(ip: str) -> str:
    return str(dns.reversename.from_address(ip))


class Zone(BaseResolver):
    """Answers from ``records`` (name -> record type -> values), which the test changes while the server runs.

    A name that is absent answers NXDOMAIN; a name present without records of the asked type answers no
    records; a record type in ``servfail`` answers SERVFAIL; while ``answering`` is False no query gets any answer
    (a DNS outage: every query times out).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, dict[str, list[str]]] = {}
        self.servfail: set[str] = set()
        self.answering = True

    def set(self, name: str, rtype: str, *values: str) -> None:
        with self.lock:
            self.records.setdefault(name, {})[rtype] = list(values)

    def drop(self, name: str) -> None:
        with self.lock:
            self.records.pop(name, None)

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        if not self.answering:
            raise DNSError(SILENT)  # dnslib's handler sends nothing back
        reply = request.reply()
        qname, rtype = str(request.q.qname).lower(), QTYPE[request.q.qtype]
        with self.lock:
            if rtype in self.servfail:
                reply.header.rcode = RCODE.SERVFAIL
            elif qname not in self.records:
                reply.header.rcode = RCODE.NXDOMAIN
            for value in self.records.get(qname, {}).get(rtype, []) if rtype in RDATA else []:
                reply.add_answer(RR(qname, getattr(QTYPE, rtype), rdata=RDATA[rtype](value), ttl=0))
        return reply


class DnsServer:
    def __init__(self) -> None:
        self.zone = Zone()
        self.server = DNSServer(self.zone, address="127.0.0.1", port=0, logger=DNSLogger("-request,-reply,-truncated", logf=_log))
        self.port = self.server.server.server_address[1]
        self.thread = threading.Thread(target=self.server.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.running = True

    def url(self, name: str, port: int) -> str:
        return f"dns://{name}:{port}?server=127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.stop()
            self.thread.join()
            self.server.server.server_close()


def _log(line: str) -> None:
    if SILENT not in line:
        print(line)
