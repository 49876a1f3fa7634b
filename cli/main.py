import typer
app = typer.Typer()
@app.command()
def chat():
    print("hi")
@app.command()
def generate():
    print("gen")
