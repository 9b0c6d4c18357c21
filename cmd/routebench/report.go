package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
func us(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond)) }
func mibps(bps float64) string  { return fmt.Sprintf("%.0f MiB/s", bps/(1<<20)) }

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func (r *report) print(w io.Writer) {
	_, _ = fmt.Fprintf(w, "routebench: %s\n\n", r.header)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "measure\tn\tp50\tp95\tmean\ttarget\tresult")
	cs := summarize(r.cycles.wakes)
	_, _ = fmt.Fprintf(tw, "pause → wake (one dial) → close → setPower paused: %d/%d cycles completed\t%d\t%s\t%s\t%s\tall cycles complete\t%s\n",
		r.cycles.completed, r.cycles.asked, cs.n, ms(cs.p50), ms(cs.p95), ms(cs.mean), verdict(r.cycles.asked > 0 && r.cycles.completed == r.cycles.asked))
	for _, wk := range r.wakes {
		s := summarize(wk.latencies)
		target, ok := "p50 ≤ 50 ms", s.p50 <= 50*time.Millisecond
		if wk.from == controller.PowerStopped {
			target, ok = "p50 ≤ 500 ms, first dial upgraded", s.p50 <= 500*time.Millisecond && wk.firstOK == len(wk.latencies)+len(wk.refusals)
		}
		if s.n == 0 {
			ok = false
		}
		_, _ = fmt.Fprintf(tw, "%s → upgraded (first dial upgraded %d/%d)\t%d\t%s\t%s\t%s\t%s\t%s\n", wk.from, wk.firstOK,
			wk.firstOK+len(wk.refusals), s.n, ms(s.p50), ms(s.p95), ms(s.mean), target, verdict(ok))
	}
	d, rl, pp := r.rtt[pathDirect], r.rtt[pathRelayed], r.rtt[pathPipe]
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, direct\t%d\t%s\t%s\t%s\t\t\n", d.n, us(d.p50), us(d.p95), us(d.mean))
	ratio := float64(rl.p50) / float64(d.p50)
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, relayed\t%d\t%s\t%s\t%s\t≤ 1.5× direct (p50)\t%.2f× %s\n", rl.n, us(rl.p50), us(rl.p95), us(rl.mean), ratio, verdict(ratio <= 1.5))
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, plain pipe (floor)\t%d\t%s\t%s\t%s\t\t%.2f×\n", pp.n, us(pp.p50), us(pp.p95), us(pp.mean), float64(pp.p50)/float64(d.p50))
	_ = tw.Flush()

	_, _ = fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "throughput\tmessage\tdirect\trelayed\tplain pipe (floor)\trelayed/direct\tpipe/direct\ttarget\tresult")
	for _, t := range r.throughput {
		ratio := t.bps[pathRelayed] / t.bps[pathDirect]
		target, result := "", ""
		if t.label == "1 MiB" {
			target, result = "≥ 0.9× direct", verdict(ratio >= 0.9)
		}
		_, _ = fmt.Fprintf(tw, "%s %s\t%d B\t%s (%d)\t%s (%d)\t%s (%d)\t%.2f\t%.2f\t%s\t%s\n", t.direction, t.label, t.messageBytes,
			mibps(t.bps[pathDirect]), t.msgs[pathDirect], mibps(t.bps[pathRelayed]), t.msgs[pathRelayed],
			mibps(t.bps[pathPipe]), t.msgs[pathPipe], ratio, t.bps[pathPipe]/t.bps[pathDirect], target, result)
	}
	_ = tw.Flush()

	m := r.mem
	_, _ = fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "idle relays\tprovider RSS before\tafter\tper relay\tGo heap/relay\tstacks/relay\tgoroutines/relay\ttarget\tresult")
	_, _ = fmt.Fprintf(tw, "%d (provider counts %d; opened in %s)\t%.1f MiB\t%.1f MiB\t%.1f KiB\t%.1f KiB\t%.1f KiB\t%.1f\t≤ 64 KiB\t%s\n",
		m.relays, m.relaysSeenByProvider, m.openedIn.Round(time.Millisecond), float64(m.before.RSSBytes)/(1<<20), float64(m.after.RSSBytes)/(1<<20),
		m.perRelay/1024, m.heapPerRelay/1024, m.stackPerRelay/1024, m.goroutinesPerRelay, verdict(m.perRelay <= 64<<10))
	_ = tw.Flush()
	if len(r.cycles.failures) > 0 {
		_, _ = fmt.Fprintf(w, "\npause/wake cycles that failed:\n  %s\n", strings.Join(r.cycles.failures, "\n  "))
	}
	for _, wk := range r.wakes {
		if len(wk.refusals) > 0 {
			_, _ = fmt.Fprintf(w, "\nrefused first dials from %s:\n  %s\n", wk.from, strings.Join(wk.refusals, "\n  "))
		}
	}
	_, _ = fmt.Fprintln(w, "\nRound trips: env/getIdle requests of exactly 64 bytes, one at a time, in interleaved blocks on every path.")
	_, _ = fmt.Fprintln(w, "Downloads: fs/readFile answers of the size shown, four in flight. Uploads: notifications of the size shown")
	_, _ = fmt.Fprintln(w, "(read and dropped by the daemon), then one request as a barrier. Direct is the provider's own GuestDialer")
	_, _ = fmt.Fprintln(w, "connection to the same daemon; the plain pipe is a loopback port in the provider process that copies bytes to")
	_, _ = fmt.Fprintln(w, "the daemon through the same GuestDialer and reads nothing (the floor of any relay). Every path uses the same")
	_, _ = fmt.Fprintln(w, "WebSocket client; message counts in parentheses. RSS is measured after a full GC.")
}
