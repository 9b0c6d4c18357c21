package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

func (p *proc) end() uint64 { return p.outStart + uint64(len(p.out)) }

func (p *proc) appendOutput(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.out = append(p.out, b...)
	if len(p.out) > p.outLimit {
		// Drop down to three quarters of the limit, so the copy is amortised.
		drop := len(p.out) - p.outLimit*3/4
		n := copy(p.out, p.out[drop:])
		p.out = p.out[:n]
		p.outStart += uint64(drop)
	}
	p.notifyLocked()
}

// drain copies the output pipe into the stream until end-of-file, then
// closes eof: supervise waits on it, within settleTimeout, before it
// reports the root exited, so that the last output is there to be read.
func (p *proc) drain(r *os.File, eof chan<- struct{}) {
	defer close(eof)
	defer closePipes(r)
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			p.appendOutput(buf[:n])
		}
		if err != nil {
			break
		}
	}
	p.mu.Lock()
	p.outEOF = true
	p.notifyLocked()
	p.mu.Unlock()
}

func (d *Daemon) processRead(ctx context.Context, raw json.RawMessage) (any, error) {
	var p ProcessReadParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if p.After != nil && p.TailBytes != nil {
		return nil, jsonrpc.InvalidParams("tailBytes", "The members after and tailBytes exclude each other; send at most one.")
	}
	if p.MaxBytes == 0 {
		return nil, jsonrpc.InvalidParams("maxBytes", "The member maxBytes must be at least 1.")
	}
	if ceiling := d.limits.Process.MaxReadBytes; p.MaxBytes > ceiling {
		return nil, ceilingError("maxBytes", ceiling, p.MaxBytes)
	}
	if ceiling := d.limits.MaxWaitMs; p.WaitMs > ceiling {
		return nil, ceilingError("waitMs", ceiling, p.WaitMs)
	}
	returnOn := p.ReturnOn
	if returnOn == "" {
		returnOn = ReturnOnAnyOutput
	}
	pr, err := d.procs.lookup(p.ProcessID)
	if err != nil {
		return nil, err
	}

	pr.mu.Lock()
	locked := true
	defer func() {
		if locked {
			pr.mu.Unlock()
		}
	}()
	end := pr.end()
	if p.Ack != nil {
		if *p.Ack > end {
			return nil, jsonrpc.InvalidParams("ack", "The member ack is %d, beyond the end of the output (%d).", *p.Ack, end)
		}
		pr.cursor = max(pr.cursor, *p.Ack)
	}
	var pos uint64
	cursorRead := false
	switch {
	case p.After != nil:
		if *p.After > end {
			return nil, jsonrpc.InvalidParams("after", "The member after is %d, beyond the end of the output (%d).", *p.After, end)
		}
		pos = *p.After
	case p.TailBytes != nil:
		pos = end - min(*p.TailBytes, end)
	default:
		pos = pr.cursor
		cursorRead = true
	}

	ready := func() bool {
		if pr.exited {
			return true
		}
		switch returnOn {
		case ReturnOnAnyOutput:
			return pr.end() > pos
		case ReturnOnWindow:
			return pr.end() >= pos+p.MaxBytes
		}
		return false
	}
	if !ready() && p.WaitMs > 0 {
		timer := time.NewTimer(time.Duration(p.WaitMs) * time.Millisecond)
		defer timer.Stop()
	wait:
		for !ready() {
			ch := pr.changed
			pr.mu.Unlock()
			locked = false
			select {
			case <-ch:
			case <-timer.C:
				pr.mu.Lock()
				locked = true
				break wait
			case <-ctx.Done():
				return nil, jsonrpc.WithReason(jsonrpc.KindAborted, "cancelled", "The read was cancelled; the output cursor did not move.")
			}
			pr.mu.Lock()
			locked = true
		}
	}
	res := pr.pageLocked(pos, p.MaxBytes)
	if cursorRead && res.Next > pr.cursor {
		// The shared server offers no hook for "the reply was written", so the
		// cursor moves when the answer is handed to it.
		pr.cursor = res.Next
	}
	return res, nil
}

func (p *proc) pageLocked(pos, maxBytes uint64) ProcessReadResult {
	res := ProcessReadResult{End: p.end(), State: "running"}
	cur := pos
	if cur < p.outStart {
		res.Gaps = []OutputGap{{Offset: cur, SizeBytes: p.outStart - cur, Reason: "overflow"}}
		cur = p.outStart
	}
	if cur < res.End {
		n := min(maxBytes, res.End-cur)
		from := cur - p.outStart
		res.Chunks = []OutputChunk{{Offset: cur, Data: base64.StdEncoding.EncodeToString(p.out[from : from+n])}}
		cur += n
	}
	res.Next = cur
	if p.exited {
		res.State = "exited"
		res.Exit = p.exit
		res.StoppedBy = p.stoppedBy
		res.Leftovers = p.leftovers
	}
	return res
}
