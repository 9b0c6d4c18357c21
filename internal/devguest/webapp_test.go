package devguest

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
)

func TestWebApp(t *testing.T) {
	srv := httptest.NewServer(WebApp())
	defer srv.Close()
	client := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

	resp, err := client.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(page), "new EventSource('/events')") || !strings.Contains(string(page), "/ws") {
		t.Fatalf("the page: %.200s", page)
	}

	resp, err = client.Get(srv.URL + "/events")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(resp.Body)
	var data []string
	for sc.Scan() && len(data) < SSEEvents+1 {
		if l, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			data = append(data, l)
		}
	}
	resp.Body.Close()
	if strings.Join(data, ",") != "event-1,event-2,event-3,done" {
		t.Fatalf("events: %v", data)
	}

	ws, _, err := websocket.DefaultDialer.Dial("ws"+strings.TrimPrefix(srv.URL, "http")+"/ws", nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = ws.WriteMessage(websocket.TextMessage, []byte("hi"))
	_ = ws.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, msg, err := ws.ReadMessage(); err != nil || string(msg) != "echo: hi" {
		t.Fatalf("echo: %q %v", msg, err)
	}
	ws.Close()

	body := bytes.Repeat([]byte("z"), 3<<20)
	resp, err = client.Post(srv.URL+"/echo", "application/octet-stream", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Equal(got, body) {
		t.Fatalf("echo of 3 MiB: %d bytes", len(got))
	}
	resp, err = client.Post(srv.URL+"/count", "application/octet-stream", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.TrimSpace(string(got)) != "3145728" {
		t.Fatalf("count: %q", got)
	}
	resp, err = client.Get(srv.URL + "/redirect")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "/" {
		t.Fatalf("redirect: %d %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	resp, err = client.Get(srv.URL + "/bytes?n=100000")
	if err != nil {
		t.Fatal(err)
	}
	got, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if len(got) != 100000 {
		t.Fatalf("bytes: %d", len(got))
	}
}
