package devguest

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/gorilla/websocket"
)

// DefaultWebPort is the dev guest's public ingress port (the dev
// templates' ingressPort), on the guest loopback like the daemon.
const DefaultWebPort = 8080

const maxEcho = 64 << 20

// SSEEvents is how many server-sent events /events streams before its
// "done" event.
const SSEEvents = 3

// WebApp is the dev guest's web app behind public ingress: a page that
// streams server-sent events and opens a WebSocket echo, so that every
// ingress test, and a browser, has a real upstream that streams, upgrades,
// uploads, downloads and redirects.
//
//	GET /          the page; its text shows what the stream and the echo delivered
//	GET /?hold     the page, and a WebSocket it keeps: a message every 250 ms,
//	               and when it drops, a new one 250 ms later; its text counts
//	               the sockets opened and the echoes received
//	GET /events    SSEEvents events "event-1"…, then an event "done"; held open until the client leaves
//	GET /ws        a WebSocket that echoes every message with "echo: " before it
//	GET /headers   the request's headers and Host, as JSON
//	GET /bytes?n=N N bytes of 'x', streamed
//	POST /echo     the request body back (at most 64 MiB, read whole first)
//	POST /count    the request body's length, read as it streams
//	GET /redirect  302 to /
func WebApp() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = io.WriteString(w, page)
	})
	mux.HandleFunc("GET /events", serveEvents)
	mux.HandleFunc("GET /ws", serveEcho)
	mux.HandleFunc("GET /headers", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"host": r.Host, "headers": r.Header})
	})
	mux.HandleFunc("GET /bytes", serveBytes)
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		// Read whole before answering: an HTTP/1.1 server may stop reading
		// a body once its answer has started.
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxEcho))
		if err != nil {
			http.Error(w, "the body must be at most 64 MiB", http.StatusRequestEntityTooLarge)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(body)
	})
	mux.HandleFunc("POST /count", func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			http.Error(w, "the body did not arrive whole", http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "%d\n", n)
	})
	mux.HandleFunc("GET /redirect", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/", http.StatusFound)
	})
	return mux
}

func serveEvents(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	for i := 1; i <= SSEEvents; i++ {
		if _, err := fmt.Fprintf(w, "id: %d\ndata: event-%d\n\n", i, i); err != nil {
			return
		}
		if rc.Flush() != nil {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	_, _ = io.WriteString(w, "event: done\ndata: done\n\n")
	_ = rc.Flush()
	// Held open, as a live stream is: an EventSource whose stream ended
	// would connect again. A minute bounds a client that never leaves.
	select {
	case <-r.Context().Done():
	case <-time.After(time.Minute):
	}
}

// upgrader keeps gorilla's same-origin check: the edge passes the
// browser's Host through, so the page's own origin matches.
var upgrader = websocket.Upgrader{HandshakeTimeout: 10 * time.Second}

func serveEcho(w http.ResponseWriter, r *http.Request) {
	c, err := upgrader.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	defer func() { _ = c.Close() }()
	c.SetReadLimit(1 << 20)
	for {
		_ = c.SetReadDeadline(time.Now().Add(time.Minute))
		kind, msg, err := c.ReadMessage()
		if err != nil {
			return
		}
		_ = c.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if err := c.WriteMessage(kind, append([]byte("echo: "), msg...)); err != nil {
			return
		}
	}
}

func serveBytes(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
	if err != nil || n < 0 || n > 8<<30 {
		http.Error(w, "n must be a byte count from 0 to 8 GiB", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	chunk := make([]byte, 64<<10)
	for i := range chunk {
		chunk[i] = 'x'
	}
	for n > 0 {
		k := min(n, int64(len(chunk)))
		if _, err := w.Write(chunk[:k]); err != nil {
			return
		}
		n -= k
	}
}

// page writes what it receives into its own text, which is what a headless
// browser's DOM dump shows.
const page = `<!doctype html>
<html><head><meta charset="utf-8"><title>Lightspeed dev guest</title></head>
<body>
<h1>Lightspeed dev guest</h1>
<p id="sse">sse:</p>
<p id="ws">ws:</p>
<script>
const sse = document.getElementById('sse'), wsText = document.getElementById('ws');
const es = new EventSource('/events');
es.onmessage = (e) => { sse.textContent += ' ' + e.data; };
es.addEventListener('done', () => { es.close(); sse.textContent += ' [sse done]'; });
es.onerror = () => { sse.textContent += ' [sse error]'; };
const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/ws');
ws.onopen = () => ws.send('hello from the browser');
ws.onmessage = (e) => { wsText.textContent += ' ' + e.data + ' [ws done]'; ws.close(); };
ws.onerror = () => { wsText.textContent += ' [ws error]'; };
if (location.search.includes('hold')) {
  const held = document.createElement('p');
  held.id = 'held';
  document.body.appendChild(held);
  let opened = 0, echoes = 0, sent = 0;
  const show = () => { held.textContent = 'held: opened ' + opened + ' echoes ' + echoes; };
  const open = () => {
    const s = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/ws');
    let timer;
    s.onopen = () => { opened++; show(); timer = setInterval(() => s.send('held ' + (++sent)), 250); };
    s.onmessage = () => { echoes++; show(); };
    s.onclose = () => { clearInterval(timer); setTimeout(open, 250); };
  };
  show();
  open();
}
</script>
</body></html>
`
